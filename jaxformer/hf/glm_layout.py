"""GLM-4 and GLM-4.5 (glm4, glm4_moe): their rows (jaxformer.hf.model_type.HFModelType).

Both are the Llama layout with a share of each head rotated (partial_rotary_factor,
transformers' default 0.5: the first half) and biases on q, k and v alone (attention_bias;
o_proj has none), read as model.qkv_bias.

GLM-4 (Glm4ForCausalLM): a norm before and after each sublayer, inside the residual, which
is model.block="sandwich" under its own names (input_layernorm, post_self_attn_layernorm,
post_attention_layernorm, post_mlp_layernorm); gate|up fused in one gate_up_proj; its rotated
dimensions pair adjacently (2i, 2i+1), permuted to jaxformer's half rotation and back.

GLM-4.5 (Glm4MoeForCausalLM): pre-LN; QK-norm per head where use_qk_norm; half rotation;
DeepSeek-V3's experts: sigmoid scores with the selection bias (e_score_correction_bias),
group-limited choice (n_group, topk_group), renormalised (norm_topk_prob) and scaled
(routed_scaling_factor), the first first_k_dense_replace layers dense, n_shared_experts
ungated shared experts. Its multi-token-prediction layers, stored as layers past the last,
are model.mtp_depth's modules (jaxformer.hf.mla_layout.mtp_rules), read where the folder
holds them and written.
"""

from __future__ import annotations

import dataclasses

from jaxformer.hf import llama_layout, mla_layout, twists
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.tensors import Rule, split_rows
from jaxformer.model.config import ModelConfig
from jaxformer.model.kinds import QK_NORMS

# our sandwich block's norms -> GLM-4's tensors (under model.layers.N.)
GLM4_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_self_attn_layernorm",
              "ffn_norm": "post_attention_layernorm", "ffn_post_norm": "post_mlp_layernorm"}


def glm4_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules with GLM-4's norm names (GLM4_NORMS) and each layer's
    gate|up fused in mlp.gate_up_proj [2F, D] (gate rows first)."""
    d, f, t = cfg.d_model, cfg.d_ff, row.tensor_prefix
    rules = []
    for rule in llama_layout.tensor_rules(cfg, row, rope_layout):
        block, part = rule.ours[0][:2]
        if part == "ffn" and rule.ours[0][2] in ("wi_gate", "wi_up"):
            continue  # fused below, once per layer
        if part in GLM4_NORMS:
            name = f"{t}layers.{block.removeprefix('block_')}.{GLM4_NORMS[part]}.weight"
            rule = dataclasses.replace(rule, hf=(name,))
        rules.append(rule)
    rules += [split_rows((f"block_{i}", "ffn"), ("wi_gate", "wi_up"),
                         f"{t}layers.{i}.mlp.gate_up_proj.weight", (f, f), d, ((d, f), (d, f)))
              for i in range(cfg.n_layers)]
    return rules


def _attention_keys(get) -> dict:
    """q, k and v's biases (attention_bias), and the QK-norm per head (use_qk_norm)."""
    return dict(qkv_bias=bool(get("attention_bias")),
                qk_norm="head" if get("use_qk_norm") else "none")


def _attention_to_hf(cfg: ModelConfig) -> dict:
    """attention_bias and use_qk_norm; another QK-norm, or biases beyond q, k and v, read
    back otherwise (the round trip of jaxformer.convert.hf_config refuses them)."""
    return dict(attention_bias=cfg.qkv_bias,
                use_qk_norm=QK_NORMS[cfg.qk_norm].query_axes is not None)


def _glm4_to_hf(cfg: ModelConfig) -> dict:
    return dict(attention_bias=cfg.qkv_bias)


def _groups(get) -> tuple[int, int]:  # group-limited routing: n_group groups, topk_group kept
    return get("n_group") or 1, get("topk_group") or 1


def _groups_to_hf(m) -> dict:
    return dict(n_group=m.groups, topk_group=m.topk_groups)


def _glm4_moe_to_hf(cfg: ModelConfig) -> dict:
    # the multi-token-prediction layers written: model.mtp_depth's (mla_layout.mtp_rules)
    return dict(_attention_to_hf(cfg), num_nextn_predict_layers=cfg.mtp_depth)


ROWS = [
    HFModelType(
        "glm4", ("Glm4ForCausalLM", "Glm4Model"), export_rank=50,
        defaults=dict(num_key_value_heads=2, head_dim=128, hidden_act="silu",
                      max_position_embeddings=131072, rms_norm_eps=1.5625e-07,
                      tie_word_embeddings=False, attention_bias=True, rope_theta=10000.0,
                      partial_rotary_factor=0.5),
        block="sandwich", biases="none", tensor_rules=glm4_rules, rope_layout="interleaved",
        rotary_fraction_key="partial_rotary_factor",
        extra=lambda get: dict(qkv_bias=bool(get("attention_bias"))), extra_to_hf=_glm4_to_hf),
    HFModelType(
        "glm4_moe", ("Glm4MoeForCausalLM", "Glm4MoeModel"), export_rank=51,
        defaults=dict(num_key_value_heads=8, head_dim=None, hidden_act="silu",
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0,
                      partial_rotary_factor=0.5, use_qk_norm=False, num_experts_per_tok=8,
                      n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                      first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=1,
                      **twists.ROUTER_LOSS),
        biases="none", rotary_fraction_key="partial_rotary_factor",
        tensor_rules=mla_layout.with_mtp(llama_layout.tensor_rules),
        extra=lambda get: {**_attention_keys(get), **mla_layout.mtp_keys(get)},
        extra_to_hf=_glm4_moe_to_hf,
        extra_layers="GLM-4.5's multi-token-prediction layers past num_nextn_predict_layers "
        "(or without eh_proj), which jaxformer does not read",
        moe=MoEFormat("mlp", "gate", ("n_routed_experts", "num_local_experts"), "sigmoid",
                      "norm_topk_prob", "moe_intermediate_size",
                      first_dense_key="first_k_dense_replace", shared_count_key="n_shared_experts",
                      groups=_groups, groups_to_hf=_groups_to_hf,
                      scale_key="routed_scaling_factor")),
]
