"""RoPE scalings as a table: one row per `rope_scaling.kind`, holding the fields it reads,
its inverse frequencies, and its form in a Hugging Face config.json. Config validation,
rope_tables and the converters read it; a new scaling is one row plus its math.

Formulas follow the reference implementations of each method (Hugging Face
transformers' ``modeling_rope_utils``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from jaxformer.core.validation import ConfigError, Section, check_choice, check_number


@dataclasses.dataclass(frozen=True)
class RopeScaling(Section):
    """How RoPE frequencies are stretched to reach past the training length.

    kind: a row of ROPE_SCALINGS: none | linear (positions / factor) |
      ntk (theta * factor^(d/(d-2))) | yarn (Peng et al. 2023, per-frequency ramp +
      attention temperature) | llama3 (Meta's Llama 3.1 wavelength-band rule).
    original_max_seq_len: the length the model was trained at (yarn, llama3);
      None means ModelConfig.max_seq_len. The other fields belong to the kinds named.
    """

    kind: str = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 * ln(factor) + 1
    truncate: bool = True             # yarn: the correction range rounded out to whole dims

    def __post_init__(self):
        o = "rope_scaling"
        check_choice(o, "kind", self.kind, ROPE_SCALINGS)
        check_number(o, "factor", self.factor, float, low=0, low_open=True)
        row = ROPE_SCALINGS[self.kind]
        if self.factor < row.min_factor:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be >= {row.min_factor:g} "
                              f"for kind={self.kind}")
        check_number(o, "original_max_seq_len", self.original_max_seq_len, int, low=1, optional=True)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            check_number(o, name, getattr(self, name), float, low=0, low_open=True)
        check_number(o, "attention_factor", self.attention_factor, float, low=0, low_open=True,
                      optional=True)
        if row.check is not None:
            row.check(self)

    SECTION = "rope_scaling"

    @property
    def row(self) -> "Scaling":
        return ROPE_SCALINGS[self.kind]


@dataclasses.dataclass(frozen=True)
class Scaling:
    """One RoPE scaling.

    inv_freq(inv_freq float64 [H/2], head_dim, theta, s: RopeScaling) -> (inverse
      frequencies, attention factor); the attention factor multiplies cos and sin (so q.k
      scales by its square), 1 but for YaRN. scales: False for the row that leaves RoPE
      as it is.
    theta(theta, head_dim, s) -> the base the frequencies start from (NTK stretches it).
    needs_original: it reads original_max_seq_len (filled from the model's max_seq_len).
    min_factor: the least factor it takes. check(s): raises ConfigError on bad fields.
    hf_type: its rope_type in config.json (None: transformers has no such scaling), and
    hf_keys: the rope_parameters keys it writes, each to the RopeScaling field it is;
    hf_read: keys it also reads; from_hf(params, max_len, key) -> RopeScaling where
    reading is more than renaming keys (key: where the params sit in config.json).
    """

    inv_freq: Callable
    scales: bool = True
    theta: Callable | None = None
    needs_original: bool = False
    min_factor: float = 0.0
    check: Callable | None = None
    hf_type: str | None = None
    hf_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hf_read: tuple[str, ...] = ()
    from_hf: Callable | None = None


def _unscaled(inv_freq, head_dim, theta, s):
    return inv_freq, 1.0


def _linear(inv_freq, head_dim, theta, s):  # position interpolation: pos / factor
    return inv_freq / s.factor, 1.0


def _ntk_theta(theta, head_dim, s):  # NTK-aware: stretch the base so the lowest
    if head_dim < 4:                 # frequency interpolates
        raise ValueError(f"NTK RoPE scaling needs head_dim >= 4, got {head_dim}")
    return theta * s.factor ** (head_dim / (head_dim - 2))


def _llama3(inv_freq, head_dim, theta, s):
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


def _check_llama3(s):
    if s.high_freq_factor <= s.low_freq_factor:
        raise ConfigError("rope_scaling.high_freq_factor must be > low_freq_factor "
                          f"(got {s.high_freq_factor} <= {s.low_freq_factor})")


def _yarn(inv_freq, head_dim, theta, s):
    def correction_dim(rotations):
        return head_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:  # the paper's and transformers' default; gpt-oss keeps the fractions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1 for fast-rotating dims (kept), 0 for slow ones (interpolated)
    inv_freq = inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv_freq, attention_factor


def _yarn_from_hf(params: Mapping[str, Any], max_len: int, key: str) -> RopeScaling:
    """As transformers' _compute_yarn_parameters: a missing factor is max_len / original;
    mscale and mscale_all_dim give the attention factor when it is not written. key: the
    config.json key the params came from (for errors)."""
    if params.get("truncate", True) not in (True, False):
        raise ConfigError(f"config.json {key}.truncate={params['truncate']!r} must be true "
                          "or false")
    original = params.get("original_max_position_embeddings", max_len)
    factor = params.get("factor") or max_len / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all:
        m = lambda x: 1.0 if factor <= 1 else 0.1 * x * math.log(factor) + 1.0  # noqa: E731
        attention_factor = m(mscale) / m(mscale_all)
    return RopeScaling("yarn", factor=float(factor), original_max_seq_len=original,
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       attention_factor=None if attention_factor is None
                       else float(attention_factor), truncate=params.get("truncate", True))


ORIGINAL = "original_max_position_embeddings"  # HF's key for original_max_seq_len

ROPE_SCALINGS: dict[str, Scaling] = {
    "none": Scaling(_unscaled, scales=False, hf_type="default"),
    "linear": Scaling(_linear, hf_type="linear", hf_keys={"factor": "factor"}),
    "ntk": Scaling(_unscaled, theta=_ntk_theta, min_factor=1.0),
    "yarn": Scaling(_yarn, needs_original=True, min_factor=1.0, hf_type="yarn",
                    hf_keys={"factor": "factor", "beta_fast": "beta_fast",
                             "beta_slow": "beta_slow", ORIGINAL: "original_max_seq_len",
                             "attention_factor": "attention_factor"},
                    hf_read=("mscale", "mscale_all_dim", "truncate"), from_hf=_yarn_from_hf),
    "llama3": Scaling(_llama3, needs_original=True, min_factor=1.0, check=_check_llama3,
                      hf_type="llama3",
                      hf_keys={"factor": "factor", "low_freq_factor": "low_freq_factor",
                               "high_freq_factor": "high_freq_factor",
                               ORIGINAL: "original_max_seq_len"}),
}


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] (float64) and the attention factor for RoPE,
    as the scaling's row computes them."""
    scaling = scaling or RopeScaling()
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    row = scaling.row
    if row.needs_original and scaling.original_max_seq_len is None:
        raise ValueError(f"rope scaling {scaling.kind!r} needs original_max_seq_len (the "
                         "training length)")
    if row.theta is not None:
        theta = row.theta(theta, head_dim, scaling)
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # [H/2]
    return row.inv_freq(1.0 / theta ** exponents, head_dim, theta, scaling)
