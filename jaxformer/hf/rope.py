"""RoPE in config.json (transformers 5's rope_parameters, 4.x's rope_theta and rope_scaling)
<-> jaxformer's rope_theta and RopeScaling, and the share of a head it rotates, shared by
every RoPE family; and the errors that name a config.json key jaxformer cannot read or a
model field HF cannot express."""

from __future__ import annotations

from typing import Any, Mapping

from jaxformer.model.config import ConfigError, ModelConfig
from jaxformer.positions.rope_scaling import ROPE_SCALINGS, RopeScaling

# rope_type in config.json -> the RopeScaling row that reads it
HF_TYPES = {row.hf_type: kind for kind, row in ROPE_SCALINGS.items() if row.hf_type}


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
    if kind not in HF_TYPES:
        raise unsupported(f"{key}.rope_type", kind, f"supported: "
                          f"{', '.join(sorted(HF_TYPES))} ('dynamic' NTK changes with the "
                          "input length; jaxformer's ntk is static)")
    row = ROPE_SCALINGS[HF_TYPES[kind]]
    unknown = sorted(set(params) - set(row.hf_keys) - set(row.hf_read))
    if unknown:
        raise unsupported(key, dict(params, rope_type=kind),
                          f"unknown key(s) {', '.join(unknown)} for rope_type {kind!r}")
    if row.from_hf is not None:
        return theta, row.from_hf(params, max_len, key)
    fields = {field: params[k] for k, field in row.hf_keys.items() if k in params}
    if row.needs_original:
        fields.setdefault("original_max_seq_len", max_len)
    return theta, RopeScaling(HF_TYPES[kind], **{
        f: v if f == "original_max_seq_len" else float(v) for f, v in fields.items()})


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return rope_dict(cfg.rope_theta, cfg.rope_scaling)


def rope_dict(theta: float, s: RopeScaling) -> dict[str, Any]:
    """rope_parameters (transformers 5) of a RoPE base and scaling."""
    row = s.row
    if row.hf_type is None:
        raise cannot("rope_scaling.kind", s.kind, "transformers has no such scaling (for ntk: "
                     "its 'dynamic' changes with the input length)")
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": row.hf_type}
    rope.update({k: getattr(s, field) for k, field in row.hf_keys.items()
                 if getattr(s, field) is not None})
    return dict(rope, truncate=s.truncate) if "truncate" in row.hf_read else rope
