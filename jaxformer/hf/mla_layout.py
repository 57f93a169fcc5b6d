"""Multi-head latent attention in the DeepSeek families (a row with `mla`, jaxformer.hf.families):
config.json keys <-> model.mla (jaxformer.attention.mla.MLAConfig) and the softmax scale, and the
tensor rules of an MLA layer's attention.

Theirs, under model.layers.N.self_attn.: q_a_proj [q_lora_rank, D], q_a_layernorm, q_b_proj
[N (nope + rope), q_lora_rank] (or q_proj [N (nope + rope), D]); kv_a_proj_with_mqa
[kv_lora_rank + rope, D], kv_a_layernorm; kv_b_proj [N (nope + v), kv_lora_rank]; o_proj
[D, N v]. Ours: jaxformer.model.latent_attention.MLAttention's params. DeepSeek stores the rotated
slices' pairs interleaved (rope_interleave; V2's complex rotation likewise): they are
permuted to jaxformer's half rotation on the way in and back on the way out.

Multi-token prediction (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers; model.mtp_depth,
jaxformer.model.mtp): module k is the checkpoint's layer n_layers + k - 1 (with_mtp's rules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jaxformer.attention.mla import MLAConfig
from jaxformer.hf.rope import unsupported
from jaxformer.hf.tensors import (Path, Rule, copied, linear, permute_half_to_interleaved,
                                  permute_interleaved_to_half)
from jaxformer.model.config import ModelConfig

KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def read_mla(hf, get) -> tuple[MLAConfig, float | None]:
    """model.mla, and the logits' scale when YaRN's mscale_all_dim corrects it (DeepSeek:
    1 / sqrt(nope + rope) * mscale^2, mscale = 0.1 mscale_all_dim ln(factor) + 1); None:
    the default 1 / sqrt(nope + rope)."""
    if get("num_key_value_heads") not in (None, get("num_attention_heads")):
        raise unsupported("num_key_value_heads", get("num_key_value_heads"), "an MLA layer's "
                          "keys and values are per head (num_attention_heads)")
    mla = MLAConfig(**{k: get(k) or 0 for k in KEYS})
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor, all_dim = rope.get("factor") or 1.0, rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", "default") == "default" or not all_dim or factor <= 1:
        return mla, None
    mscale = 0.1 * all_dim * math.log(factor) + 1.0
    return mla, mscale * mscale / math.sqrt(mla.qk_head_dim)


def write_mla(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of model.mla (q_lora_rank 0 is written as null: a full query)."""
    out = {k: getattr(cfg.mla, k) for k in KEYS}
    out["q_lora_rank"] = out["q_lora_rank"] or None
    return dict(out, num_key_value_heads=cfg.n_heads, head_dim=cfg.mla.qk_rope_head_dim)


def mla_rope(cfg: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters with the mscale_all_dim that gives model.attn_scale (read_mla's
    inverse); a scale no YaRN factor gives is left for the round trip to name."""
    factor = rope.get("factor") or 1.0
    if cfg.attn_scale is None or rope.get("rope_type") == "default" or factor <= 1:
        return rope
    mscale = math.sqrt(cfg.attn_scale * math.sqrt(cfg.mla.qk_head_dim))
    return dict(rope, mscale_all_dim=(mscale - 1.0) / (0.1 * math.log(factor)))


def _rope_tail(start: int):
    """(to_ours, to_hf) permuting the last axis from `start` on between interleaved pairs
    and half rotation (the rotated slice of a query head, or of the latent's projection)."""
    def apply(f):
        return lambda x: np.concatenate([x[..., :start], f(x[..., start:])], axis=-1)
    return apply(permute_interleaved_to_half), apply(permute_half_to_interleaved)


def _split_heads(a: Path, name: str, r: int, n: int, nope: int, v: int) -> Rule:
    """kv_b_proj [N (nope + v), R] <-> key_up [R, N, nope], value_up [R, N, v]."""
    def to_ours(w):
        per_head = w.T.reshape(r, n, nope + v)
        return per_head[..., :nope], per_head[..., nope:]
    return Rule((a + ("key_up",), a + ("value_up",)), (name,), ((n * (nope + v), r),), to_ours,
                lambda k, val: (np.concatenate([k, val], -1).reshape(r, -1).T,))


def mla_rules(cfg: ModelConfig, a: Path, p: str) -> list[Rule]:
    """The rules of an MLA layer's attention: a (its params' path) <-> names under p."""
    m, d, n = cfg.mla, cfg.d_model, cfg.n_heads
    qk, r, rope = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    rules = []
    if m.q_lora_rank:
        q = m.q_lora_rank
        rules += [linear(a + ("q_down", "kernel"), f"{p}q_a_proj.weight", (q, d), (d, q)),
                  copied(a + ("q_down_norm", "scale"), f"{p}q_a_layernorm.weight", (q,)),
                  linear(a + ("q_up", "kernel"), f"{p}q_b_proj.weight", (n * qk, q), (q, n, qk),
                         _rope_tail(m.qk_nope_head_dim))]
    else:
        rules.append(linear(a + ("query", "kernel"), f"{p}q_proj.weight", (n * qk, d), (d, n, qk),
                            _rope_tail(m.qk_nope_head_dim)))
    rules += [linear(a + ("kv_down", "kernel"), f"{p}kv_a_proj_with_mqa.weight", (r + rope, d),
                     (d, r + rope), _rope_tail(r)),
              copied(a + ("kv_norm", "scale"), f"{p}kv_a_layernorm.weight", (r,)),
              _split_heads(a, f"{p}kv_b_proj.weight", r, n, m.qk_nope_head_dim, m.v_head_dim),
              linear(a + ("out", "kernel"), f"{p}o_proj.weight", (d, n * m.v_head_dim),
                     (n, m.v_head_dim, d))]
    return rules


def mtp_held(cfg: ModelConfig, names, prefix: str) -> ModelConfig:
    """cfg with no MTP modules where the folder's tensor names hold none (transformers saves
    DeepSeek-V3 and GLM-4.5 without them, num_nextn_predict_layers or not)."""
    first = f"layers.{cfg.n_layers}.eh_proj.weight"
    if cfg.mtp_depth and not {prefix + first, first} & set(names):
        return cfg.replace(mtp_depth=0)
    return cfg


def mtp_rules(cfg: ModelConfig, row, main: list[Rule]) -> list[Rule]:
    """The MTP modules' rules: module k <-> layer n_layers + k - 1: enorm, hnorm, eh_proj
    [D, 2D] (the embedding's half first), the last layer's tensors as its block,
    shared_head.norm as its output norm; and its copies of the embedding (embed_tokens) and
    head (shared_head.head), written from the model's own and read where the model's
    own come later (main's rules)."""
    t, d, v, last = row.tensor_prefix, cfg.d_model, cfg.vocab_size, cfg.n_layers - 1
    rules = []
    for k in range(1, cfg.mtp_depth + 1):
        m, p, was = f"mtp_{k}", f"{t}layers.{last + k}.", f"{t}layers.{last}."
        rules += [copied((m, "enorm", "scale"), f"{p}enorm.weight", (d,)),
                  copied((m, "hnorm", "scale"), f"{p}hnorm.weight", (d,)),
                  linear((m, "eh_proj", "kernel"), f"{p}eh_proj.weight", (d, 2 * d), (2 * d, d)),
                  copied((m, "norm", "scale"), f"{p}shared_head.norm.weight", (d,)),
                  copied(("embed", "embedding"), f"{p}embed_tokens.weight", (v, d)),
                  copied(("embed", "embedding"), f"{p}shared_head.head.weight", (v, d))
                  if cfg.tie_embeddings else
                  linear(("lm_head", "kernel"), f"{p}shared_head.head.weight", (v, d), (d, v))]
        rules += [dataclasses.replace(r, ours=tuple((m, "block") + o[1:] for o in r.ours),
                                      hf=tuple(h.replace(was, p, 1) for h in r.hf))
                  for r in main if r.ours[0][0] == f"block_{last}"]
    return rules


def with_mtp(tensor_rules: Callable) -> Callable:
    """A row's tensor_rules with the MTP modules' (mtp_rules) before them."""
    def rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
        main = tensor_rules(cfg, row, rope_layout)
        return mtp_rules(cfg, row, main) + main
    return rules


def mtp_keys(get) -> dict[str, Any]:
    """model.mtp_depth from num_nextn_predict_layers (mtp_held drops it where the folder
    holds no such layer)."""
    return dict(mtp_depth=get("num_nextn_predict_layers") or 0)
