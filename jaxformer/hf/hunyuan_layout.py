"""Hunyuan (hunyuan_v1_dense, hunyuan_v1_moe): their rows (jaxformer.hf.model_type.HFModelType).

The Llama layout (jaxformer.hf.llama_layout) with Hunyuan's twists:
- QK-norm per head AFTER the rotation (model.qk_norm head_after_rope), its weights
  self_attn.query_layernorm / key_layernorm;
- RoPE "dynamic" with an `alpha` (transformers' ntk_alpha: the base times
  alpha^(d / (d - 2)), whatever the length) is jaxformer's static ntk scaling of factor alpha;
- the mixture of experts (hunyuan_v1_moe): every layer sparse, a softmax router over every
  expert (mlp.gate.wg) whose top moe_topk are renormalised (softmax over the chosen:
  topk_softmax), experts of width intermediate_size, and one ungated shared MLP of that
  width (mlp.shared_mlp). moe_topk may list one value per layer: one value, or refused.

transformers' config classes ignore the original checkpoints' keys use_cla, use_qk_norm,
use_mixed_mlp_moe, num_shared_expert and moe_intermediate_size; a value of theirs that is
not the model transformers builds is refused (one line naming it) rather than misread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.rope import unsupported
from jaxformer.hf.tensors import Rule
from jaxformer.model.config import ModelConfig, RopeScaling

# HF q/k norm names of the Llama layout's -> Hunyuan's
QK_NORM_TENSORS = {".self_attn.q_norm.": ".self_attn.query_layernorm.",
                   ".self_attn.k_norm.": ".self_attn.key_layernorm."}
# jaxformer's RoPE scalings that Hunyuan spells its own way: kind -> rope_parameters
OWN_ROPES = {"ntk": lambda theta, s: {"rope_type": "dynamic", "alpha": s.factor, "factor": 1.0,
                                      "rope_theta": theta}}


def _rope_alpha(hf) -> tuple[dict, float | None]:
    """(config.json keys to read in place of a "dynamic" RoPE with an alpha: its plain RoPE,
    the alpha); ({}, None) for any other RoPE."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    kind = params.get("rope_type", params.get("type"))
    if kind != "dynamic" or not params.get("alpha"):
        return {}, None
    theta = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    return {"rope_scaling": None, "rope_parameters": {"rope_type": "default", **theta}}, \
        float(params["alpha"])


def _one_per_layer(get, key: str, n_layers: int, why: str):
    """The value of a key that may list one per layer: its one value, or refused."""
    value = get(key)
    if not isinstance(value, list):
        return value
    if len(value) != n_layers or len(set(value)) != 1:
        raise unsupported(key, value, why)
    return value[0]


def _moe_keys(hf, get, row) -> dict:
    """The mixture's keys as the Llama layout's reader reads them: the one top-k, and no
    auxiliary loss (transformers' Hunyuan adds none); the legacy width and shared-expert
    keys checked against the model transformers builds."""
    if row.moe is None:
        return {}
    n, name = get("num_hidden_layers"), row.name
    if isinstance(get("num_experts"), list):
        raise unsupported("num_experts", get("num_experts"), f"{name}'s experts are one "
                          "number for every layer (transformers builds no other)")
    top_k = _one_per_layer(get, "moe_topk", n, f"{name} in jaxformer routes each layer to "
                           "the same number of experts")
    width = _one_per_layer(get, "moe_intermediate_size", n, f"{name}'s experts are one width")
    if width not in (None, get("intermediate_size")):
        raise unsupported("moe_intermediate_size", width, f"{name}'s experts are "
                          "intermediate_size wide in transformers")
    if _one_per_layer(get, "num_shared_expert", n, f"{name} has one shared MLP") != 1:
        raise unsupported("num_shared_expert", get("num_shared_expert"), f"{name} has one "
                          "shared MLP per layer (shared_mlp)")
    return {"num_experts_per_tok": top_k, "output_router_logits": False}


def read_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of a Hunyuan config.json: the Llama layout's reader on the keys
    rewritten as it reads them (the top-k, a plain RoPE for an alpha's), then the ntk
    scaling of the alpha."""
    rope, alpha = _rope_alpha(hf)
    changed = {**rope, **_moe_keys(hf, get, row)}
    hf = {**hf, **changed}

    def reread(key, *default):
        return changed[key] if key in changed else get(key, *default)

    cfg = llama_layout.read_config(hf, reread, row)
    return cfg if alpha is None else cfg.replace(rope_scaling=RopeScaling("ntk", factor=alpha))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of a Hunyuan model: the Llama layout's, the top-k as moe_topk, an
    ntk scaling as the "dynamic" RoPE with an alpha."""
    own = OWN_ROPES.get(cfg.rope_scaling.kind)
    plain = cfg if own is None else cfg.replace(rope_scaling=RopeScaling())
    out = llama_layout.write_config(plain, row)
    if own is not None:
        rope = own(cfg.rope_theta, cfg.rope_scaling)
        out.update(rope_parameters=rope,
                   rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    if row.moe is not None:
        out["moe_topk"] = out.pop("num_experts_per_tok")
        out.pop("router_aux_loss_coef", None)  # transformers' Hunyuan has no such loss
    return out


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules, the QK-norm weights under Hunyuan's names."""
    def renamed(name: str) -> str:
        for ours, theirs in QK_NORM_TENSORS.items():
            name = name.replace(ours, theirs)
        return name

    return [dataclasses.replace(r, hf=tuple(renamed(n) for n in r.hf))
            for r in llama_layout.tensor_rules(cfg, row, rope_layout)]


DEFAULTS = dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                head_dim=None, rope_theta=10000.0, use_cla=False, use_qk_norm=True)
REFUSE = (("use_cla", (False, None), "jaxformer's layers share no keys and values across "
           "layers (cross-layer attention), nor do transformers'"),
          ("use_qk_norm", (True, None), "transformers' Hunyuan norms queries and keys"))
HUNYUAN = dict(read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
               qk_norm="head_after_rope", biases="attention")

ROWS: list = [
    HFModelType(
        "hunyuan_v1_dense", ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model"),
        export_rank=55, defaults=DEFAULTS, refuse=REFUSE, **HUNYUAN),
    HFModelType(
        "hunyuan_v1_moe", ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Model"), export_rank=56,
        # router_aux_loss_coef: none in transformers' Hunyuan (its writer drops the key)
        defaults=dict(DEFAULTS, moe_topk=1, output_router_logits=False, use_mixed_mlp_moe=True,
                      moe_intermediate_size=None, num_shared_expert=1, router_aux_loss_coef=0.0),
        refuse=REFUSE + (("use_mixed_mlp_moe", (True, None), "transformers' Hunyuan MoE "
                          "has a shared MLP in every layer"),),
        moe=MoEFormat("mlp", "gate.wg", ("num_experts", "num_local_experts"), "topk_softmax",
                      shared_mlp="shared_mlp"),
        **HUNYUAN),
]
