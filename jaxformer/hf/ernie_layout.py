"""ERNIE 4.5 (ernie4_5, ernie4_5_moe): the Llama layout with its twists, and their rows
(jaxformer.hf.model_type.HFModelType).

ERNIE 4.5 is Llama's computation: pre-LN RMSNorm blocks, SwiGLU, GQA, RoPE, except that
its checkpoints rotate q and k in interleaved pairs (2i, 2i+1) (transformers repeats each
frequency twice: cos[..., :H/2].repeat_interleave(2)), permuted to jaxformer's half
rotation on load and back on save, and that one key, use_bias, puts biases on q, k, v, o
and the MLP. A dense ERNIE 4.5 therefore computes as a Llama: to_hf writes it as llama
unless asked for model_type="ernie4_5".

ERNIE 4.5 MoE adds, in the layers i with (i + 1) % moe_layer_interval == 0 and
moe_layer_start_index <= i <= moe_layer_end_index (-1: the last), a mixture of
moe_num_experts experts of width moe_intermediate_size, moe_k of them per token, routed by
jaxformer.moe.experts' softmax_bias router: softmax scores, the choice by scores + the
selection bias (mlp.moe_statics.e_score_correction_bias [1, E]), the chosen weights
divided by max(their sum, moe_norm_min); beside them moe_num_shared_experts shared experts
as one MLP of width moe_num_shared_experts * moe_intermediate_size (mlp.shared_experts,
biased with use_bias). The other layers: an MLP of width intermediate_size. With use_bias
the LM head has a bias too (lm_head.bias, model.head_bias), even when tied.
"""

from __future__ import annotations

import math
from typing import Any

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Rule, copied, reshaped
from jaxformer.model.config import ModelConfig
from jaxformer.moe.experts import ROUTERS

ROUTER = "softmax_bias"  # jaxformer.moe.experts.ROUTERS' entry routing as ERNIE 4.5 MoE
# a key Ernie4_5_MoeConfig maps onto its own (attribute_map) -> that key
ALIASES = {"num_experts_per_tok": "moe_k"}


def _biases(get) -> dict[str, bool]:
    """use_bias: biases on q, k, v, o and the MLP."""
    return dict(use_bias=bool(get("use_bias")), qkv_bias=bool(get("use_bias")))


def _moe_biases(get) -> dict[str, bool]:
    """use_bias in ERNIE 4.5 MoE: also on the shared experts and the LM head."""
    return dict(_biases(get), head_bias=bool(get("use_bias")))


def sparse_layers(get) -> tuple[int, ...] | None:
    """The sparse layers as Ernie4_5_MoeDecoderLayer chooses them (None: all)."""
    n, every = get("num_hidden_layers"), get("moe_layer_interval")
    if not isinstance(every, int) or every < 1:
        raise unsupported("moe_layer_interval", every, "it must be a positive integer "
                          "(ernie4_5_moe)")
    start, end = get("moe_layer_start_index"), get("moe_layer_end_index")
    end = n - 1 if end == -1 else end
    sparse = tuple(i for i in range(n) if (i + 1) % every == 0 and start <= i <= end)
    return None if len(sparse) == n else sparse


def read_moe_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of an ERNIE 4.5 MoE config.json: the Llama layout's, moe_k read as
    the experts per token, and the sparse layers chosen by sparse_layers."""
    def aliased(key, *default):
        return get(ALIASES[key], *default) if key in ALIASES and key not in hf else \
            get(key, *default)
    cfg = llama_layout.read_config(hf, aliased, row)
    return cfg.replace(moe=cfg.moe.replace(layers=sparse_layers(aliased)))


def _interval(sparse: list[int]) -> int | None:
    """The moe_layer_interval that, between the first and last sparse layer, chooses
    exactly `sparse` (None: none does); the largest that divides every i + 1 is the only
    candidate, as any other divisor chooses more."""
    every = math.gcd(*[i + 1 for i in sparse])
    chosen = [i for i in range(sparse[0], sparse[-1] + 1) if (i + 1) % every == 0]
    return every if chosen == sparse else None


def write_moe_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of an ERNIE 4.5 MoE model: the Llama layout's, with moe_k and
    the sparse layers as start, end and interval."""
    out = llama_layout.write_config(cfg, row)
    out["moe_k"] = out.pop("num_experts_per_tok")
    sparse = [i for i, s in enumerate(cfg.sparse_layers) if s]
    every = _interval(sparse) if sparse else None
    if every is None:
        raise cannot("moe.layers", sparse, "ERNIE 4.5 MoE's sparse layers are every "
                     "moe_layer_interval-th between a first and a last")
    return dict(out, moe_layer_start_index=sparse[0], moe_layer_end_index=sparse[-1],
                moe_layer_interval=every, moe_norm_min=ROUTERS[cfg.moe.router].norm_min)


def moe_tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules with ERNIE 4.5 MoE's names: the selection bias under
    mlp.moe_statics [1, E]; with use_bias the shared experts' biases and lm_head.bias."""
    e, d, t = cfg.moe.experts, cfg.d_model, row.tensor_prefix
    rules = []
    for rule in llama_layout.tensor_rules(cfg, row, rope_layout):
        name = rule.hf[0]
        if name.endswith(".gate.e_score_correction_bias"):
            rule = reshaped(rule.ours[0], name.replace(".gate.", ".moe_statics."), (1, e), (e,))
        rules.append(rule)
    if cfg.use_bias:
        s = cfg.shared_d_ff
        rules += [copied((f"block_{i}", "ffn", "shared", ours, "bias"),
                         f"{t}layers.{i}.mlp.shared_experts.{hf}.bias", (size,))
                  for i in range(cfg.n_layers) if cfg.sparse_layers[i] and s
                  for ours, hf, size in (("wi_gate", "gate_proj", s), ("wi_up", "up_proj", s),
                                         ("wo", "down_proj", d))]
    if cfg.head_bias:
        rules.append(copied(("head_bias",), "lm_head.bias", (cfg.vocab_size,)))
    return rules


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        "ernie4_5", ("Ernie4_5ForCausalLM", "Ernie4_5Model"), export_rank=52,
        defaults=dict(num_key_value_heads=2, hidden_act="silu", max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, use_bias=False,
                      head_dim=128, rope_theta=500000.0),
        biases="none", rope_layout="interleaved", extra=_biases,
        extra_to_hf=lambda cfg: dict(use_bias=cfg.use_bias)),
    HFModelType(
        "ernie4_5_moe", ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeModel"), export_rank=53,
        defaults=dict(num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, use_bias=False,
                      head_dim=None, rope_theta=500000.0, moe_k=6, moe_num_shared_experts=2,
                      moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1,
                      moe_norm_min=1e-12, output_router_logits=False,
                      router_aux_loss_coef=0.001),
        read_config=read_moe_config, write_config=write_moe_config,
        tensor_rules=moe_tensor_rules, biases="none", rope_layout="interleaved",
        extra=_moe_biases, extra_to_hf=lambda cfg: dict(use_bias=cfg.use_bias),
        moe=MoEFormat("mlp", "gate", ("moe_num_experts", "num_experts"), ROUTER,
                      expert_d_ff_key="moe_intermediate_size",
                      shared_count_key="moe_num_shared_experts"),
        refuse=(("moe_norm_min", (ROUTERS[ROUTER].norm_min,), "jaxformer's softmax_bias "
                 "router clamps the chosen weights' sum at 1e-12"),)),
]
