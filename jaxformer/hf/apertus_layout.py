"""Apertus (apertus): its row (jaxformer.hf.model_type.HFModelType).

The Llama layout (jaxformer.hf.llama_layout) with Apertus's twists:
- an MLP without a gate, down(xIELU(up x)): model.ffn xielu, whose learned scalars per layer
  (mlp.act_fn.alpha_p, alpha_n [1]; beta, eps [], buffers in transformers) are the ffn
  module's params alpha_p, alpha_n, beta, eps [] (jaxformer.model.kinds.FFNS);
- its norms named attention_layernorm and feedforward_layernorm; QK-norm per head before
  the rotation (q_norm, k_norm), as Qwen3;
- a config.json without any RoPE key has transformers' default, Llama 3's scaling
  (LLAMA3_ROPE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.rope import unsupported
from jaxformer.hf.tensors import Rule, reshaped
from jaxformer.model.config import ModelConfig

ACTIVATIONS = {"xielu": "xielu"}  # hidden_act -> model.ffn (the first is the default)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
               "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}
# HF names of the Llama layout's -> Apertus's
TENSORS = {".input_layernorm.": ".attention_layernorm.",
           ".post_attention_layernorm.": ".feedforward_layernorm."}
# xIELU's scalars: HF shape of each (ours are [])
SCALARS = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}


def read_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of an Apertus config.json: the Llama layout's reader with the
    xIELU MLP read as jaxformer's xielu FFN."""
    act = get(row.act_key)
    if act not in ACTIVATIONS:
        raise unsupported(row.act_key, act, f"{row.name}'s MLP in jaxformer is "
                          f"{', '.join(ACTIVATIONS)} (its other activations have no gate, which "
                          "jaxformer's silu and gelu FFNs have)")
    changed: dict[str, Any] = {row.act_key: "silu"}  # read as the Llama layout's, then xielu
    if not {"rope_parameters", "rope_scaling", "rope_theta"} & set(hf):
        changed["rope_parameters"] = LLAMA3_ROPE  # as ApertusConfig fills it in

    def reread(key, *default):
        return changed[key] if key in changed else get(key, *default)

    cfg = llama_layout.read_config({**hf, **changed}, reread, row)
    return cfg.replace(ffn=ACTIVATIONS[act])


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """The Llama layout's keys with the xIELU activation (a model of another FFN reads
    back otherwise, and is not written as Apertus)."""
    names = {ffn: act for act, ffn in ACTIVATIONS.items()}
    return dict(llama_layout.write_config(cfg, row),
                **{row.act_key: names.get(cfg.ffn, next(iter(ACTIVATIONS)))})


def _mlp(rule: Rule) -> list[Rule]:
    """A Llama-layout rule as Apertus has it: the gate dropped (no such projection), the
    up projection into ffn/wi, the norms renamed."""
    path = rule.ours[0]
    if path[1:] == ("ffn", "wi_gate", "kernel"):
        return []
    if path[1:] == ("ffn", "wi_up", "kernel"):
        rule = dataclasses.replace(rule, ours=((path[0], "ffn", "wi", "kernel"),))
    names = []
    for name in rule.hf:
        for ours, theirs in TENSORS.items():
            name = name.replace(ours, theirs)
        names.append(name)
    return [dataclasses.replace(rule, hf=tuple(names))]


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout's rules for a gateless MLP and Apertus's norm names, and each
    layer's xIELU scalars."""
    rules = [r for rule in llama_layout.tensor_rules(cfg, row, rope_layout)
             for r in _mlp(rule)]
    t = row.tensor_prefix
    rules += [reshaped((f"block_{i}", "ffn", name), f"{t}layers.{i}.mlp.act_fn.{name}", shape,
                       ()) for i in range(cfg.n_layers) for name, shape in SCALARS.items()]
    return rules


ROWS: list = [
    HFModelType(
        "apertus", ("ApertusForCausalLM", "ApertusModel"), export_rank=57,
        defaults=dict(num_key_value_heads=None, hidden_act="xielu", head_dim=None,
                      max_position_embeddings=65536, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_bias=False, rope_theta=12000000.0),
        read_config=read_config, write_config=write_config, tensor_rules=tensor_rules,
        qk_norm="head", biases="attention"),
]
