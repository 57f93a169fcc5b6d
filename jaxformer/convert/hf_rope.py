"""RoPE in config.json (transformers 5's rope_parameters, 4.x's rope_theta and rope_scaling)
<-> jaxformer's rope_theta and RopeScaling, and the share of a head it rotates, shared by
every RoPE family; and the errors that name a config.json key jaxformer cannot read or a
model field HF cannot express."""

from __future__ import annotations

import math
from typing import Any, Mapping

from jaxformer.config import ConfigError, ModelConfig, RopeScaling

ROPE_KEYS = {  # rope_parameters keys each rope_type may carry
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
}


def unsupported(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {key}={value!r} is not supported: {why}")


def cannot(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"model.{field}={value!r} cannot be written as a Hugging Face "
                       f"checkpoint: {why}")


def rotary_fraction(hf, get, key: str = "partial_rotary_factor") -> float:
    """The share of each head a config.json rotates, read as transformers 5 reads it:
    rope_parameters' (or 4.x's rope_scaling's) partial_rotary_factor, else the top-level
    `key` (GPT-NeoX: rotary_pct; its top-level partial_rotary_factor is not read), else
    get's default for it, else 1. A null is no value, as in transformers."""
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(where) or {}
    name, value = f"{where}.partial_rotary_factor", params.get("partial_rotary_factor")
    if value is None:
        name, value = key, get(key, None)
    if value is None:
        return 1.0
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise unsupported(name, value, "the rotary fraction must be in (0, 1]")
    return float(value)


def rope_from_hf(hf, get, max_len: int, theta_key: str = "rope_theta"
                 ) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) of a config.json; theta_key: the top-level key holding
    theta when rope_parameters does not (GPT-NeoX 4.x: rotary_emb_base). A
    partial_rotary_factor among the parameters is rotary_fraction's to read."""
    # transformers 5 writes rope_parameters (rope_theta inside); 4.x wrote rope_theta and
    # rope_scaling (null for plain RoPE). Like transformers, rope_scaling wins when both exist.
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(key) or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise unsupported(key, params, "per-layer-type RoPE parameters")
    # get(theta_key) only when needed: a family without a default for it raises
    theta = params.pop("rope_theta") if "rope_theta" in params else get(theta_key)
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("partial_rotary_factor", None)
    if kind not in ROPE_KEYS:
        raise unsupported(f"{key}.rope_type", kind, f"supported: {', '.join(ROPE_KEYS)} "
                          "('dynamic' NTK changes with the input length; jaxformer's ntk is "
                          "static)")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise unsupported(key, dict(params, rope_type=kind),
                          f"unknown key(s) {', '.join(unknown)} for rope_type {kind!r}")
    original = params.get("original_max_position_embeddings", max_len)
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_seq_len=original)
    # yarn, as transformers' _compute_yarn_parameters
    if params.get("truncate", True) is not True:
        raise unsupported(f"{key}.truncate", params["truncate"], "jaxformer's YaRN rounds the "
                          "correction range (truncate=true)")
    factor = params.get("factor") or max_len / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all:
        m = lambda s: 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0  # noqa: E731
        attention_factor = m(mscale) / m(mscale_all)
    return theta, RopeScaling("yarn", factor=float(factor), original_max_seq_len=original,
                              beta_fast=float(params.get("beta_fast") or 32),
                              beta_slow=float(params.get("beta_slow") or 1),
                              attention_factor=None if attention_factor is None
                              else float(attention_factor))


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return rope_dict(cfg.rope_theta, cfg.rope_scaling)


def rope_dict(theta: float, s: RopeScaling) -> dict[str, Any]:
    """rope_parameters (transformers 5) of a RoPE base and scaling."""
    rope: dict[str, Any] = {"rope_theta": theta}
    if s.kind == "none":
        return dict(rope, rope_type="default")
    if s.kind == "linear":
        return dict(rope, rope_type="linear", factor=s.factor)
    if s.kind == "llama3":
        return dict(rope, rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_seq_len)
    if s.kind == "yarn":
        rope.update(rope_type="yarn", factor=s.factor, beta_fast=s.beta_fast,
                    beta_slow=s.beta_slow, original_max_position_embeddings=s.original_max_seq_len,
                    truncate=True)
        if s.attention_factor is not None:
            rope["attention_factor"] = s.attention_factor
        return rope
    raise cannot("rope_scaling.kind", s.kind, "transformers has no static NTK scaling (its "
                 "'dynamic' changes with the input length)")
