"""LFM2 (Liquid AI): gated short convolutions (jaxformer.model.mixers.short_conv) beside
attention: their config.json readers and writers and tensor rules, and their rows.

config.json: layer_types (conv or full_attention per layer; else full_attn_idxs, the
attention layers, all of them when absent), conv_L_cache (the convolution's taps),
conv_bias (biases on the convolution and its in/out projections), norm_eps, and the
MLP's width: intermediate_size (block_ff_dim wins), with block_auto_adjust_ff_dim two
thirds of it, times block_ffn_dim_multiplier, rounded up to block_multiple_of (Lfm2MLP);
tie_embedding wins over tie_word_embeddings. Attention: RMS QK-norm per head, RoPE.

Tensors, under model.: embed_tokens; layers.N.{operator_norm, ffn_norm} (attn_norm,
ffn_norm); a conv layer's conv.in_proj [3D, D] (B, C, x rows: in_b, in_c, in_x),
conv.conv [D, 1, K] (conv [K, D]), conv.out_proj; an attention layer's
self_attn.{q, k, v, out}_proj and {q, k}_layernorm; feed_forward.{w1, w3, w2} (wi_gate,
wi_up, wo); embedding_norm, the norm after the last layer (final_norm).

LFM2-MoE: the same layers, the first num_dense_layers with an MLP of width
intermediate_size, the rest sparse (jaxformer.hf.moe_layout: feed_forward.gate,
experts.j.{w1, w3, w2}, and the selection bias feed_forward.expert_bias).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxformer.hf.llama_layout import head_dim
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat, moe_rules, read_moe, write_moe
from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear, one_tensor, reshaped, \
    rope_permutation, split_rows
from jaxformer.model.config import ModelConfig

CONV = "short_conv"  # the conv layers' mixer
# config.json's layer type -> (our kind's name, its LayerKind fields)
KINDS = {"conv": ("conv", {"mixer": CONV}), "full_attention": ("attn", {})}


def _layer_types(hf, get, row) -> list[str]:
    """Each layer's type: layer_types, else full_attn_idxs (the attention layers; all of
    them when absent), as Lfm2Config reads them."""
    n = get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        attn = get("full_attn_idxs")
        attn = range(n) if attn is None else attn
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise unsupported("layer_types", types, f"it must list one type per layer ({n})")
    bad = sorted(set(types) - set(KINDS))
    if bad:
        raise unsupported("layer_types", bad, f"{row.name} layers in jaxformer are "
                          f"{' or '.join(KINDS)}")
    return types


def _period(names: list[str]) -> tuple[str, ...]:
    """The shortest prefix that, repeated, gives `names`."""
    return next(tuple(names[:p]) for p in range(1, len(names) + 1)
                if all(names[i] == names[i % p] for i in range(len(names))))


def ffn_width(get) -> int:
    """Lfm2MLP's width: intermediate_size (block_ff_dim wins); with
    block_auto_adjust_ff_dim int(2/3 of it), then, with a block_ffn_dim_multiplier, int of
    that multiple rounded up to block_multiple_of."""
    width = get("block_ff_dim") or get("intermediate_size")
    if get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        mult = get("block_ffn_dim_multiplier")
        if mult is not None:
            step = get("block_multiple_of")
            width = step * ((int(mult * width) + step - 1) // step)
    return width


def _fields(hf, get, row, d_ff: int) -> dict[str, Any]:
    """ModelConfig fields of an LFM2 config.json (`get` reads a key or its default), its
    MLP of width d_ff."""
    for key, allowed, why in row.refuse:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({row.name})")
    if rotary_fraction(hf, get) != 1:
        raise unsupported("partial_rotary_factor", rotary_fraction(hf, get),
                          f"{row.name} rotates every dimension of a head")
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    theta, scaling = rope_from_hf(hf, get, max_len)
    names = [KINDS[t][0] for t in _layer_types(hf, get, row)]
    tie = get("tie_embedding")
    conv = {CONV: dict(kernel=get("conv_L_cache"), bias=bool(get("conv_bias")))}
    return dict(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=head_dim(get),
        d_ff=d_ff, max_seq_len=max_len, position="rope", rope_theta=float(theta),
        rope_scaling=scaling, norm=row.norm, norm_eps=float(get(row.eps_key)),
        block=row.block, qk_norm=row.qk_norm, ffn="swiglu", use_bias=False, qkv_bias=False,
        tie_embeddings=bool(get("tie_word_embeddings") if tie is None else tie),
        layer_pattern=_period(names),
        layer_kinds={name: dict(fields) for name, fields in KINDS.values() if name in names},
        mixer=conv if KINDS["conv"][0] in names else None)


def read_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of an LFM2 config.json, its MLP as wide as Lfm2MLP's (ffn_width)."""
    return ModelConfig(**_fields(hf, get, row, ffn_width(get)))


def read_moe_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of an LFM2-MoE config.json: its first num_dense_layers layers' MLP
    of width intermediate_size, the rest sparse (model.moe)."""
    return ModelConfig(**_fields(hf, get, row, get("intermediate_size")),
                       moe=read_moe(hf, get, row))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of an LFM2 model, its MLP's width as it is."""
    return dict(_write(cfg, row), block_auto_adjust_ff_dim=False)


def write_moe_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of an LFM2-MoE model: the experts' (its router's selection bias
    always on: use_expert_bias)."""
    return dict(_write(cfg, row), **write_moe(cfg, row), use_expert_bias=True)


def _write(cfg: ModelConfig, row) -> dict[str, Any]:
    """The keys both write; what LFM2 cannot say (norms, biases, windows, a RoPE per
    layer) is caught by the round trip of jaxformer.convert.hf_config."""
    types = []
    for i in cfg.layer_kind_ids:
        kind = cfg.kinds[i]
        if kind.mixer not in LAYERS or not kind.ffn:
            raise cannot("layer_kinds", f"mixer={kind.mixer}, ffn={kind.ffn}", f"{row.name}'s "
                         "layers are a short convolution or attention, each with an MLP")
        types.append(LAYERS[kind.mixer][0])
    conv = cfg.mixer_settings(CONV)
    rope = rope_dict(cfg.rope_theta, cfg.rope_scaling)
    return dict(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, norm_eps=cfg.norm_eps,
        conv_L_cache=conv.kernel, conv_bias=conv.bias, layer_types=types,
        rope_parameters=rope, initializer_range=0.02)


# ---- tensors ----------------------------------------------------------------------


def _conv(cfg: ModelConfig, m: Path, p: str, rope=None) -> list[Rule]:
    """A conv layer's mixer: in_proj [3D, D] in thirds B, C, x; the depthwise
    convolution [D, 1, K] <-> [K, D]; out_proj; their biases with conv_bias (rope: unused,
    as LAYERS calls every layer's rules)."""
    d, s = cfg.d_model, cfg.mixer_settings(CONV)
    thirds = ("in_b", "in_c", "in_x")
    rules = [split_rows(m, thirds, f"{p}in_proj.weight", (d, d, d), d, ((d, d),) * 3),
             one_tensor(m + ("conv",), f"{p}conv.weight", (d, 1, s.kernel),
                        lambda w: w[:, 0, :].T, lambda k: k.T[:, None, :]),  # [K, D]
             linear(m + ("out", "kernel"), f"{p}out_proj.weight", (d, d), (d, d))]
    if s.bias:
        rules += [Rule(tuple(m + (t, "bias") for t in thirds), (f"{p}in_proj.bias",),
                       ((3 * d,),), lambda b: tuple(np.split(b, 3)),
                       lambda *bs: (np.concatenate(bs),)),
                  copied(m + ("conv_bias",), f"{p}conv.bias", (d,)),
                  copied(m + ("out", "bias"), f"{p}out_proj.bias", (d,))]
    return rules


def _attention(cfg: ModelConfig, a: Path, p: str, rope) -> list[Rule]:
    """q/k/v/out projections and the per-head QK-norm weights (q_layernorm, k_layernorm)."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = (("query", "q_proj", n, rope), ("key", "k_proj", k, rope), ("value", "v_proj", k, None))
    rules = [linear(a + (ours, "kernel"), f"{p}{hf}.weight", (m * h, d), (d, m, h), post)
             for ours, hf, m, post in heads]
    rules.append(linear(a + ("out", "kernel"), f"{p}out_proj.weight", (d, n * h), (n, h, d)))
    return rules + [reshaped(a + (ours, "scale"), f"{p}{hf}.weight", (h,), (h,), rope)
                    for ours, hf in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))]


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """LFM2's tensors (the module docstring). rope_layout="interleaved": the checkpoint's
    q/k weights rotate interleaved pairs, permuted to half rotation and back."""
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.d_ff
    rope, t = rope_permutation(rope_layout), row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i, mixer in enumerate(cfg.layer_mixers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        module, hf, layer_rules = LAYERS[mixer][1:]
        rules += layer_rules(cfg, (b, module), f"{p}{hf}.", rope)
        rules += [copied((b, ours, "scale"), f"{p}{hf}.weight", (d,))
                  for ours, hf in (("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm"))]
        rules += _experts(cfg, row, b, p) if cfg.sparse_layers[i] else \
            [linear((b, "ffn", ours, "kernel"), f"{p}feed_forward.{hf}.weight", shape,
                    shape[::-1]) for ours, hf, shape in
             (("wi_gate", "w1", (f, d)), ("wi_up", "w3", (f, d)), ("wo", "w2", (d, f)))]
    rules.append(copied(("final_norm", "scale"), f"{t}embedding_norm.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def _experts(cfg: ModelConfig, row, b: str, p: str) -> list[Rule]:
    """A sparse layer's feed_forward (jaxformer.hf.moe_layout): gate, experts.j.{w1, w3,
    w2}, and the selection bias, which LFM2-MoE names feed_forward.expert_bias."""
    block = f"{p}{row.moe.block}."
    bias = {f"{block}{row.moe.router_tensor}.e_score_correction_bias": f"{block}expert_bias"}
    return [dataclasses.replace(r, hf=tuple(bias.get(n, n) for n in r.hf))
            for r in moe_rules(cfg, row, b, p)]


# a layer's mixer -> (its layer type, its params' module, its HF module, its rules)
LAYERS = {CONV: ("conv", "mixer", "conv", _conv),
          "attention": ("full_attention", "attn", "self_attn", _attention)}

ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        "lfm2", ("Lfm2ForCausalLM", "Lfm2Model"), export_rank=30, mixers=("attention", "short_conv"),
        defaults=dict(num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5,
                      tie_word_embeddings=True, tie_embedding=None, head_dim=None,
                      rope_theta=1e6, conv_bias=False, conv_L_cache=3, block_ff_dim=None,
                      block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                      block_auto_adjust_ff_dim=True, full_attn_idxs=None),
        read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
        qk_norm="head", eps_key="norm_eps"),
    HFModelType(
        # the first num_dense_layers layers dense, the rest sparse: sigmoid routing with a
        # selection bias, renormalised (+ 1e-6: within float32 rounding of ours) and scaled
        "lfm2_moe", ("Lfm2MoeForCausalLM", "Lfm2MoeModel"), export_rank=31, mixers=("attention", "short_conv"),
        defaults=dict(num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5,
                      tie_word_embeddings=True, tie_embedding=None, head_dim=None,
                      rope_theta=1e6, conv_bias=False, conv_L_cache=3, num_dense_layers=2,
                      num_experts_per_tok=4, use_expert_bias=True, routed_scaling_factor=1.0,
                      norm_topk_prob=True, output_router_logits=False,
                      router_aux_loss_coef=0.0),
        read_config=read_moe_config, write_config=write_moe_config, tensor_rules=tensor_rules,
        qk_norm="head", eps_key="norm_eps",
        moe=MoEFormat("feed_forward", "gate", ("num_experts",), "sigmoid", "norm_topk_prob",
                      "moe_intermediate_size", expert_tensors=("w1", "w3", "w2"),
                      first_dense_key="num_dense_layers", scale_key="routed_scaling_factor"),
        refuse=(("use_expert_bias", (True,), "jaxformer's sigmoid router has the selection "
                 "bias (feed_forward.expert_bias)"),)),
]
