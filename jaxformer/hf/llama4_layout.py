"""Llama 4's text model (llama4_text, Llama4ForCausalLM): its row (jaxformer.hf.model_type.
HFModelType), its config.json reader and writer and its tensor rules; and its multimodal
folder (llama4, Llama4ForConditionalGeneration: text_config read by the llama4_text row, the
text model's tensors under language_model.*, the vision model and projector skipped; built
by jaxformer.hf.multimodal).

The Llama layout (jaxformer.hf.llama_layout) with Llama 4's twists, each a layer kind's
setting (jaxformer.model.layer_pattern.LayerKind) or a table entry:
  RoPE layers (no_rope_layers 1, every no_rope_layer_interval-th layer otherwise NoPE) rotate
    interleaved pairs (the checkpoint's q/k permuted to half rotation) and, as layer_types
    says (chunked_attention), attend within chunks of attention_chunk_size positions
    (LayerKind.chunk); with use_qk_norm their queries and keys are x / rms(x), no weight
    (qk_norm "l2"; LayerKind.qk_norm false on the NoPE layers).
  NoPE layers attend globally; with attn_temperature_tuning their queries are times
    1 + attn_scale log(1 + floor((p + 1) / floor_scale)) (LayerKind.temperature_*).
  The sparse layers (moe_layers, else every interleave_moe_layer_step-th) route by the
    sigmoid of the top-k logits, which scales each chosen expert's input (router
    sigmoid_input), beside one ungated shared expert; experts and shared expert are
    intermediate_size wide, the dense layers' MLP intermediate_size_mlp.
Tensors under model.layers.N.feed_forward: router.weight [E, D], experts.gate_up_proj
[E, D, 2F] (gate columns, then up) and experts.down_proj [E, F, D], shared_expert.
{gate,up,down}_proj; a dense layer's gate_proj, up_proj, down_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxformer.hf import llama_layout, multimodal
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Rule, copied
from jaxformer.model.config import ModelConfig

CHUNKED, FULL = "chunked_attention", "full_attention"


def _rotated(get, n: int) -> list[bool]:
    """Each layer's RoPE: no_rope_layers (1: rotated; empty or null: every
    no_rope_layer_interval-th layer NoPE), as Llama4TextConfig fills it."""
    layers = get("no_rope_layers")
    if not layers:
        interval = get("no_rope_layer_interval")
        return [bool((i + 1) % interval) for i in range(n)]
    if not isinstance(layers, list) or len(layers) < n:
        raise unsupported("no_rope_layers", layers, f"llama4_text lists one 0/1 per layer ({n})")
    return [bool(x) for x in layers[:n]]


def _types(get, n: int, rotated: list[bool]) -> list[str]:
    """Each layer's type: layer_types, else chunked_attention where rotated (and there is
    a chunk), as Llama4TextConfig fills it."""
    chunk = get("attention_chunk_size")
    types = get("layer_types") or [CHUNKED if r and chunk is not None else FULL
                                   for r in rotated]
    if len(types) != n or set(types) - {CHUNKED, FULL}:
        raise unsupported("layer_types", types, f"llama4_text layers are {CHUNKED} or {FULL}, "
                          f"one per layer ({n})")
    if CHUNKED in types and chunk is None:
        raise unsupported("attention_chunk_size", chunk, f"llama4_text's {CHUNKED} layers "
                          "need a chunk")
    return types


def _kinds(get, n: int) -> dict[str, Any]:
    """layer_pattern and layer_kinds: a kind per (chunked, rotated)."""
    rotated = _rotated(get, n)
    tuning = bool(get("attn_temperature_tuning"))
    kinds, names = {}, []
    for rope, kind_type in zip(rotated, _types(get, n, rotated)):
        chunked = kind_type == CHUNKED
        name = ("chunked" if chunked else "full") + ("" if rope else "_nope")
        kinds[name] = dict(rope=rope, chunk=get("attention_chunk_size") if chunked else None,
                           qk_norm=rope, temperature_floor=get("floor_scale")
                           if tuning and not rope else None,
                           temperature_scale=float(get("attn_scale"))
                           if tuning and not rope else 0.0)
        names.append(name)
    period = next(p for p in range(1, n + 1) if all(names[i] == names[i % p] for i in range(n)))
    return dict(layer_pattern=tuple(names[:period]), layer_kinds=kinds)


def _sparse(get, n: int) -> tuple[int, ...]:
    """The sparse layers: moe_layers, else every interleave_moe_layer_step-th."""
    layers = get("moe_layers")
    if layers is None:
        step = get("interleave_moe_layer_step")
        if not isinstance(step, int) or step < 1:
            raise unsupported("interleave_moe_layer_step", step, "it must be a positive "
                              "integer (llama4_text)")
        layers = range(step - 1, n, step)
    return tuple(sorted(set(layers)))


def read_config(hf, get, row) -> ModelConfig:
    """The Llama layout's model with Llama 4's layers and mixture of experts."""
    cfg = llama_layout.read_config(hf, get, row)  # sizes, RoPE, norms, activation, experts
    n = cfg.n_layers
    sparse = _sparse(get, n)
    moe = dataclasses.replace(
        cfg.moe, shared_experts=1, shared_d_ff=get("intermediate_size"), aux_loss=0.0,
        layers=None if len(sparse) == n else sparse) if sparse else dataclasses.replace(
        cfg.moe, experts=0)  # Llama4ForCausalLM's loss has no balancing term
    return cfg.replace(d_ff=get("intermediate_size_mlp"), moe=moe,
                       qk_norm="l2" if get("use_qk_norm") else "none", **_kinds(get, n))


def _one(values: set, field: str, why: str):
    """The one value of `values` (None if empty), else cannot()."""
    if len(values) > 1:
        raise cannot(field, sorted(values), why)
    return values.pop() if values else None


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of a Llama 4 text model; what it cannot say (a chunk on a NoPE
    layer's kind, tuning on a RoPE layer, ...) shows in the round trip."""
    out = llama_layout.write_config(cfg, row)
    layers = [cfg.kinds[i] for i in cfg.layer_kind_ids]
    chunk = _one({k.chunk for k in layers if k.chunk}, "layer_kinds.<kind>.chunk",
                 "llama4_text has one attention_chunk_size")
    tuned = _one({(k.temperature_floor, k.temperature_scale) for k in layers
                  if k.temperature_floor}, "layer_kinds.<kind>.temperature_floor",
                 "llama4_text has one floor_scale and attn_scale")
    out.update(
        intermediate_size_mlp=cfg.d_ff,
        moe_layers=[i for i, s in enumerate(cfg.sparse_layers) if s],
        no_rope_layers=[int(k.rope) for k in layers],
        layer_types=[CHUNKED if k.chunk else FULL for k in layers],
        attention_chunk_size=chunk, use_qk_norm=cfg.qk_norm != "none",
        attn_temperature_tuning=tuned is not None,
        floor_scale=tuned[0] if tuned else row.defaults["floor_scale"],
        attn_scale=tuned[1] if tuned else row.defaults["attn_scale"])
    return out


def _experts(m, p: str, e: int, d: int, f: int) -> list[Rule]:
    """gate_up_proj [E, D, 2F] (gate, then up) <-> wi_gate, wi_up [E, D, F]; down_proj
    [E, F, D] <-> wo."""
    gate_up = Rule((m + ("wi_gate",), m + ("wi_up",)), (f"{p}experts.gate_up_proj",),
                   ((e, d, 2 * f),), lambda w: (w[..., :f], w[..., f:]),
                   lambda g, u: (np.concatenate([g, u], axis=-1),))
    return [gate_up, copied(m + ("wo",), f"{p}experts.down_proj", (e, f, d))]


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules, renamed: the feed-forward network under feed_forward
    (dense or sparse), the shared expert's name, the experts fused; no QK-norm weights."""
    rules = []
    for rule in llama_layout.tensor_rules(cfg, row, rope_layout):
        name = rule.hf[0]
        if ".q_norm." in name or ".k_norm." in name or ".experts." in name:
            continue  # the L2 norm has no weight; the experts are fused (below)
        hf = tuple(h.replace(".mlp.", ".feed_forward.").replace(".shared_experts.",
                                                                 ".shared_expert.")
                   for h in rule.hf)
        rules.append(dataclasses.replace(rule, hf=hf))
    t = row.tensor_prefix
    for i, sparse in enumerate(cfg.sparse_layers):
        if sparse:
            rules += _experts((f"block_{i}", "ffn"), f"{t}layers.{i}.feed_forward.",
                              cfg.moe.experts, cfg.d_model, cfg.expert_d_ff)
    return rules


ROWS: list = [  # HFModelType rows
    HFModelType(
        "llama4_text", ("Llama4ForCausalLM",), export_rank=60,
        defaults=dict(num_key_value_heads=8, head_dim=128, hidden_act="silu",
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_bias=False, rope_theta=500000.0,
                      num_experts_per_tok=1, moe_layers=None, interleave_moe_layer_step=1,
                      use_qk_norm=True, output_router_logits=False, router_aux_loss_coef=0.001,
                      no_rope_layers=None, no_rope_layer_interval=4, attention_chunk_size=8192,
                      layer_types=None, attn_temperature_tuning=True, floor_scale=8192,
                      attn_scale=0.1),
        read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
        biases="none", rope_layout="interleaved",
        refuse=(("attention_bias", (False,), "jaxformer's biases would reach the MLP too"),),
        moe=MoEFormat("feed_forward", "router", ("num_local_experts",), "sigmoid_input",
                      expert_d_ff_key="intermediate_size")),
    multimodal.multimodal_row(
        "llama4", "Llama4ForConditionalGeneration", 61, "llama4_text",
        text_prefix="language_model.model.", head="language_model.lm_head.weight",
        skipped={"vision model": "vision_model.", "projector": "multi_modal_projector."},
        tie_at_top=False),  # the head ties as text_config says (Llama4ForCausalLM's own)
]
