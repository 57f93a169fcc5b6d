"""MiniMax-M2 (minimax_m2): the Llama layout (jaxformer.hf.llama_layout) with its twists,
and its row.

Attention: no biases; RMS QK-norm over the whole q and k projections (q_norm [N * H],
k_norm [K * H], before RoPE: qk_norm "projection", as OLMo 2); partial RoPE on the first
rotary_dim dimensions of each head (rope_parameters' partial_rotary_factor, else a
top-level partial_rotary_factor, else rotary_dim / head_dim, as MiniMaxM2Config reads
them). Every layer sparse: sigmoid routing with a selection bias (no groups), the chosen
weights always renormalised, no shared expert.

Tensors, under model.layers.N.block_sparse_moe.: gate (the router), experts.j.{w1, w3,
w2} (gate, up, down), and the selection bias e_score_correction_bias (beside the gate,
not in it). The rest is the Llama layout's.

MiniMax's own keys, beside transformers' (the original remote code reads them):
use_qk_norm, qk_norm_type, scoring_func, use_routing_bias, shared_intermediate_size and
attn_type_list; transformers computes only their values here, and the reader refuses others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Rule
from jaxformer.model.config import ModelConfig

FAMILY = "minimax_m2"
# keys of MiniMax's own config.json that transformers does not read: the values it assumes
FIXED = dict(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
             use_routing_bias=True)


def _rotary_getter(hf, get):
    """get, with a top-level partial_rotary_factor that a config.json lacking one takes
    from rotary_dim / head_dim (MiniMaxM2Config.convert_rope_params_to_dict)."""
    def read(key, *default):
        if key == "partial_rotary_factor" and key not in hf and hf.get("rotary_dim"):
            return hf["rotary_dim"] / llama_layout.head_dim(get)
        return get(key, *default)
    return read


def _check_layers(get) -> None:
    """attn_type_list: 1 (softmax attention) for each layer, all transformers runs."""
    types = get("attn_type_list", None)
    if types is not None and any(t != 1 for t in types):
        raise unsupported("attn_type_list", types, f"{FAMILY} layers are softmax attention "
                          "(1) in transformers and jaxformer (0, lightning attention, is "
                          "MiniMax-Text-01's)")
    shared = get("shared_intermediate_size", 0)
    if shared:
        raise unsupported("shared_intermediate_size", shared, f"{FAMILY} in transformers has "
                          "no shared expert")


def read_config(hf, get, row) -> ModelConfig:
    """llama_layout's reader, rotary_dim read as partial_rotary_factor, the chosen
    experts' weights renormalised (MiniMaxM2TopKRouter always renormalises)."""
    _check_layers(get)
    cfg = llama_layout.read_config(hf, _rotary_getter(hf, get), row)
    return cfg.replace(moe=dataclasses.replace(cfg.moe, norm_topk=True))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """llama_layout's keys, with rotary_dim and MiniMax's fixed keys (the round trip of
    jaxformer.convert.hf_config catches unnormalised weights)."""
    rotary = cfg.rope_fraction * cfg.head_dim
    if rotary != int(rotary) or int(rotary) % 2:
        raise cannot("rope_fraction", cfg.rope_fraction, f"{FAMILY} rotates an even number "
                     f"of dimensions (rotary_dim) of its heads of {cfg.head_dim}")
    return dict(llama_layout.write_config(cfg, row), rotary_dim=int(rotary),
                shared_intermediate_size=0, attn_type_list=[1] * cfg.n_layers, **FIXED)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules, the selection bias named block_sparse_moe's own."""
    names = {}
    for i in range(cfg.n_layers):
        block = f"{row.tensor_prefix}layers.{i}.{row.moe.block}."
        names[f"{block}{row.moe.router_tensor}.e_score_correction_bias"] = \
            f"{block}e_score_correction_bias"
    return [dataclasses.replace(r, hf=tuple(names.get(n, n) for n in r.hf))
            for r in llama_layout.tensor_rules(cfg, row, rope_layout)]


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        # QK-norm over the whole projection, partial RoPE (rotary_dim), every layer sparse:
        # sigmoid routing with a selection bias, renormalised; Mixtral's expert names
        FAMILY, ("MiniMaxM2ForCausalLM", "MiniMaxM2Model"), export_rank=58,
        defaults=dict(num_key_value_heads=8, head_dim=128, hidden_act="silu",
                      max_position_embeddings=196608, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, rope_theta=5e6, rotary_dim=None,
                      partial_rotary_factor=None, num_experts_per_tok=8,
                      router_jitter_noise=0.0, output_router_logits=False,
                      router_aux_loss_coef=0.001, **FIXED),
        read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
        qk_norm="projection", biases="none", rotary_fraction_key="partial_rotary_factor",
        moe=MoEFormat("block_sparse_moe", "gate", ("num_local_experts", "num_experts"),
                      "sigmoid", expert_tensors=("w1", "w3", "w2")),
        refuse=(("router_jitter_noise", (0,), "jaxformer's router has no jitter noise"),
                *((key, (value,), f"transformers' {FAMILY} reads no {key}: it computes "
                                      f"as {key}={value!r}")
                  for key, value in FIXED.items()))),
]
