"""Falcon-H1 (FalconH1ForCausalLM): in every layer Llama's attention and a Mamba-2 mixer
run side by side on the same normed input (a layer kind with `parallel: mamba2`, params
block_i/attn and block_i/parallel_mixer), their outputs summed into the residual, then a
SwiGLU MLP; and its muP multipliers, each an explicit setting (the tensors are written
back as read):

- embedding_multiplier, lm_head_multiplier: model.embed_multiplier, logits_multiplier;
- attention_in_multiplier, attention_out_multiplier, mlp_multipliers (gate, down): the
  layer kind's mixer_in/out_multiplier, ffn_gate/out_multiplier;
- key_multiplier: the attention's logits' scale, key_multiplier / sqrt(head_dim)
  (model.attn_scale: the keys are linear in it, RoPE too; the cache holds keys unscaled);
- ssm_in_multiplier, ssm_out_multiplier, ssm_multipliers (z, x, B, C, dt): Mamba2Settings'
  in/out_multiplier and part_multipliers; mamba_rms_norm (none: y * silu(z)),
  mamba_norm_before_gate, mamba_d_ssm (the inner width), mamba_proj_bias (in_proj) and
  projectors_bias (out_proj): its norm, norm_before_gate, heads * head_dim, bias, out_bias.
"""

from __future__ import annotations

import math
from typing import Any

from jaxformer.hf.llama_layout import head_dim
from jaxformer.hf.mamba2_layout import (BAMBA_KEYS, MAMBA2, _bamba_attention, mixer_rules,
                                        mlp_and_norms, read_mamba2_settings,
                                        write_mamba2_settings)
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import copied, linear, rope_permutation
from jaxformer.model.config import ModelConfig

FALCON_H1_KEYS = dict(BAMBA_KEYS, d_ssm="mamba_d_ssm", norm="mamba_rms_norm",
                      norm_before_gate="mamba_norm_before_gate", out_bias="projectors_bias",
                      in_multiplier="ssm_in_multiplier", out_multiplier="ssm_out_multiplier",
                      part_multipliers="ssm_multipliers")
KIND = "hybrid"  # every layer's kind (transformers' layers_block_type)
# the layer kind's multipliers <- their config.json keys (mlp_multipliers: a pair)
KIND_KEYS = dict(mixer_in_multiplier="attention_in_multiplier",
                 mixer_out_multiplier="attention_out_multiplier")


def read_falcon_h1(hf, get, row) -> ModelConfig:
    """FalconH1ForCausalLM: one kind of layer, attention with Mamba-2 beside it and a
    SwiGLU MLP; Llama attention with RoPE; RMSNorms of rms_norm_eps."""
    for key, allowed, why in row.refuse:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({row.name})")
    if bool(get("attention_bias")) != bool(get("mlp_bias")):
        raise unsupported("attention_bias", get("attention_bias"), f"{row.name} in jaxformer "
                          f"has biases on attention and MLP alike (mlp_bias={get('mlp_bias')})")
    mlp = get("mlp_multipliers") or [1.0, 1.0]
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    theta, scaling = rope_from_hf(hf, get, max_len)
    kind = dict({k: float(get(v)) for k, v in KIND_KEYS.items()}, parallel=MAMBA2,
                ffn_gate_multiplier=float(mlp[0]), ffn_out_multiplier=float(mlp[1]))
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=head_dim(get),
        d_ff=get("intermediate_size"), max_seq_len=max_len, position="rope",
        rope_theta=float(theta), rope_scaling=scaling, rope_fraction=rotary_fraction(hf, get),
        norm="rmsnorm", norm_eps=float(get("rms_norm_eps")), ffn="swiglu",
        use_bias=bool(get("attention_bias")), tie_embeddings=bool(get("tie_word_embeddings")),
        attn_scale=float(get("key_multiplier")) / math.sqrt(head_dim(get)),
        embed_multiplier=float(get("embedding_multiplier")),
        logits_multiplier=float(get("lm_head_multiplier")),
        layer_pattern=[KIND], layer_kinds={KIND: kind},
        mixer={MAMBA2: read_mamba2_settings(get, FALCON_H1_KEYS, row.name)})


def write_falcon_h1(cfg: ModelConfig, row) -> dict[str, Any]:
    """FalconH1Config keys; a model whose layers are not all attention with Mamba-2 beside
    it and an MLP, alike in their multipliers, is refused (windows, QK-norm and the rest
    by the round trip of jaxformer.convert.hf_config)."""
    kinds = {cfg.kinds[i] for i in cfg.layer_kind_ids}
    forms = {(k.mixer, k.parallel, k.ffn) for k in kinds}
    if forms != {("attention", MAMBA2, True)}:
        raise cannot("layer_kinds", sorted(map(str, forms)), f"{row.name}'s layers are "
                     "attention with a mamba2 parallel mixer and an MLP")
    kind = next(iter(kinds))
    for name in (*KIND_KEYS, "ffn_gate_multiplier", "ffn_out_multiplier"):
        if len({getattr(k, name) for k in kinds}) > 1:
            raise cannot(f"layer_kinds.<kind>.{name}", "per kind", f"{row.name}'s is one")
    scale = 1 / math.sqrt(cfg.head_dim) if cfg.attn_scale is None else cfg.attn_scale
    rope = dict(rope_dict(cfg.rope_theta, cfg.rope_scaling),
                partial_rotary_factor=cfg.rope_fraction)
    return dict(write_mamba2_settings(cfg.mixer_settings(MAMBA2), FALCON_H1_KEYS, cfg.d_model,
                                      row.name),
                **{v: getattr(kind, k) for k, v in KIND_KEYS.items()},
                mlp_multipliers=[kind.ffn_gate_multiplier, kind.ffn_out_multiplier],
                key_multiplier=scale * math.sqrt(cfg.head_dim),
                embedding_multiplier=cfg.embed_multiplier,
                lm_head_multiplier=cfg.logits_multiplier,
                hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias, rope_parameters=rope,
                hidden_act="silu", initializer_range=0.02)


def falcon_h1_tensors(cfg: ModelConfig, row, rope_layout: str = "half") -> list:
    """FalconH1ForCausalLM's tensors, under model.: embed_tokens; layers.N.input_layernorm
    (attn_norm), self_attn (Llama's), mamba (mixer_rules, our parallel_mixer),
    pre_ff_layernorm (ffn_norm), feed_forward.{gate,up,down}_proj (Llama's MLP);
    final_layernorm (final_norm); lm_head unless tied."""
    d, v, t = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rope, s = rope_permutation(rope_layout), cfg.mixer_settings(MAMBA2)
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += _bamba_attention(cfg, (b,), p, rope)
        rules += mixer_rules(cfg, (b,), f"{p}mamba.", s, module="parallel_mixer")
        rules += mlp_and_norms(cfg, b, p)
    rules.append(copied(("final_norm", "scale"), f"{t}final_layernorm.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        "falcon_h1", ("FalconH1ForCausalLM", "FalconH1Model"), export_rank=37,
        mixers=("attention", "mamba2"),
        defaults=dict(num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
                      max_position_embeddings=8192, head_dim=None, rope_theta=10000.0,
                      mamba_d_ssm=1024, mamba_n_heads=128, mamba_d_head="auto",
                      mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                      mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
                      mamba_norm_before_gate=True, mamba_rms_norm=False,
                      time_step_limit=(0.0, math.inf), projectors_bias=False,
                      lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=None,
                      key_multiplier=1.0, attention_out_multiplier=1.0,
                      attention_in_multiplier=1.0, ssm_multipliers=[1.0] * 5,
                      ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, attention_bias=False,
                      mlp_bias=False, tie_word_embeddings=False),
        read_config=read_falcon_h1, write_config=write_falcon_h1,
        tensor_rules=falcon_h1_tensors,
        refuse=(("hidden_act", ("silu",), "its MLP (SwiGLU) and Mamba-2 convolution in "
                 "jaxformer use silu"),)),
]
