"""Mamba-2's layer (Dao and Gu 2024) as transformers' Mamba2Mixer writes it: z, x, B, C
and dt from one input projection, a short causal convolution and SiLU over x, B and C,
the SSD recurrence over the heads (jaxformer.recurrent.ssd) with the D skip, a gated
RMSNorm by silu(z) (per group), and the output projection."""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from jaxformer.core.validation import ConfigError, Section, check_number


@dataclasses.dataclass(frozen=True)
class Mamba2Settings(Section):
    """model.mixer.mamba2. heads, head_dim: the SSD heads (d_inner = heads * head_dim);
    groups: B and C's groups (n_groups); state: the state's width N (d_state / state_size);
    conv: the convolution's taps; chunk: the chunked form's length; conv_bias, bias: biases
    on the convolution and on the in/out projections; dt_min, dt_max, dt_floor: the step's
    initial range; dt_limit: the step clamped to [low, high] (high None: no limit)."""

    heads: int = 8
    head_dim: int = 64
    groups: int = 1
    state: int = 64
    conv: int = 4
    chunk: int = 256
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_floor: float = 1e-4
    dt_limit_low: float = 0.0
    dt_limit_high: float | None = None

    SECTION = "model.mixer.mamba2"

    def __post_init__(self):
        for name in ("heads", "head_dim", "groups", "state", "conv", "chunk"):
            check_number(self.SECTION, name, getattr(self, name), int, low=1)
        if self.heads % self.groups:
            raise ConfigError(f"{self.SECTION}.heads={self.heads} must be a multiple of "
                              f"groups={self.groups}")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """x, B and C side by side, as the convolution sees them."""
        return self.inner + 2 * self.groups * self.state


def cache_shapes(cfg, s: Mamba2Settings):
    """One row's cache: the state [heads, head_dim, state] (float32) and the convolution's
    last conv - 1 inputs [conv - 1, channels]."""
    import jax.numpy as jnp
    return {"state": ((s.heads, s.head_dim, s.state), jnp.float32),
            "conv": ((s.conv - 1, s.conv_channels), None)}


class Mamba2Mixer(nn.Module):
    """(written with the math: jaxformer.recurrent.ssd)"""

    cfg: object
    settings: Mamba2Settings

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None):
        raise NotImplementedError("model.layer_kinds.<kind>.mixer=mamba2 is not built yet")
