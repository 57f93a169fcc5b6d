"""Arcee's AFMoE (afmoe, the Trinity models): the Llama layout (jaxformer.hf.llama_layout)
with its twists, and its row.

Layers: sliding and global (layer_types, else every global_attn_every_n_layers-th layer
global), the global ones NoPE (RoPE on the sliding layers alone); four norms per layer
around each sublayer (block "sandwich", their scales weight * x: not Gemma's 1 + weight).
Attention: RMS QK-norm per head before RoPE; each head's output times sigmoid(gate_proj x)
before o_proj (attn_output_gate, the gate without a bias). muP (mup_enabled): the
embeddings times sqrt(hidden_size). The first num_dense_layers layers a dense MLP of
width intermediate_size, the rest sparse: sigmoid routing with a selection bias (no
groups), the chosen weights renormalised and times route_scale, num_shared_experts
experts' worth of shared MLP (one MLP of num_shared_experts * moe_intermediate_size).

Tensors, under model.layers.N.: input_layernorm, post_attention_layernorm,
pre_mlp_layernorm, post_mlp_layernorm (attn_norm, attn_post_norm, ffn_norm,
ffn_post_norm); self_attn.gate_proj [N * H, D] (attn/gate [D, N, H]); a sparse layer's
mlp.router.gate (the router), mlp.expert_bias (the selection bias), mlp.experts.j.{gate,
up, down}_proj and mlp.shared_experts.{gate, up, down}_proj. The rest is the Llama
layout's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxformer.hf import llama_layout, twists
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.tensors import Rule, linear
from jaxformer.model.config import ModelConfig

# the Llama layout's names (block "sandwich", the selection bias) -> AFMoE's
NAMES = {".pre_feedforward_layernorm.": ".pre_mlp_layernorm.",
         ".post_feedforward_layernorm.": ".post_mlp_layernorm.",
         ".router.gate.e_score_correction_bias": ".expert_bias"}


def _renamed(name: str) -> str:
    for ours, theirs in NAMES.items():
        name = name.replace(ours, theirs)
    return name


def _extra(get) -> dict:
    """The gated attention, and muP's embedding scale."""
    scale = math.sqrt(get("hidden_size")) if get("mup_enabled") else 1.0
    return dict(attn_output_gate=True, embed_multiplier=scale)


def _extra_to_hf(cfg: ModelConfig) -> dict:
    """mup_enabled: embeddings times sqrt(d_model) (another multiplier, or no gate, is
    caught by the round trip of jaxformer.convert.hf_config)."""
    return dict(mup_enabled=cfg.embed_multiplier != 1.0)


def read_config(hf, get, row) -> ModelConfig:
    """llama_layout's reader, the chosen experts' weights renormalised
    (AfmoeTokenChoiceRouter always renormalises)."""
    cfg = llama_layout.read_config(hf, get, row)
    return cfg.replace(moe=dataclasses.replace(cfg.moe, norm_topk=True))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """llama_layout's keys (global_attn_every_n_layers left to layer_types)."""
    return llama_layout.write_config(cfg, row)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules under AFMoE's names (NAMES), and each layer's gate."""
    d, n, h = cfg.d_model, cfg.n_heads, cfg.head_dim
    rules = [dataclasses.replace(r, hf=tuple(_renamed(name) for name in r.hf))
             for r in llama_layout.tensor_rules(cfg, row, rope_layout)]
    return rules + [linear((f"block_{i}", "attn", "gate", "kernel"),
                           f"{row.tensor_prefix}layers.{i}.self_attn.gate_proj.weight",
                           (n * h, d), (d, n, h))
                    for i in range(cfg.n_layers) if cfg.attn_output_gate]


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        # sliding and NoPE global layers, sandwich norms, gated attention, muP's embedding
        # scale; dense first layers, then sigmoid routing with a selection bias,
        # renormalised and scaled, and shared experts
        "afmoe", ("AfmoeForCausalLM", "AfmoeModel"), export_rank=59,
        defaults=dict(num_key_value_heads=None, head_dim=128, hidden_act="silu",
                      max_position_embeddings=16384, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0,
                      num_experts_per_tok=6, num_shared_experts=2, num_dense_layers=1,
                      route_scale=1.0, global_attn_every_n_layers=4, sliding_window=1024,
                      layer_types=None, mup_enabled=False, output_router_logits=False,
                      router_aux_loss_coef=0.0),
        read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
        block="sandwich", qk_norm="head", biases="attention",
        layer_type=twists.global_every(4, "global_attn_every_n_layers"), layer_types_key=True,
        rope_of=twists.sliding_rotated, extra=_extra, extra_to_hf=_extra_to_hf,
        moe=MoEFormat("mlp", "router.gate", ("num_experts",), "sigmoid", None,
                      "moe_intermediate_size", first_dense_key="num_dense_layers",
                      shared_count_key="num_shared_experts", scale_key="route_scale")),
]
