"""The gated delta rule layer (Gated DeltaNet, Yang et al. 2024) as Qwen3-Next and Qwen3.5
write it: q, k, v from the input through a short causal convolution and SiLU, q and k
L2-normalised, per-head decay g = -exp(A_log) softplus(a + dt_bias) and write strength
beta = sigmoid(b), the delta rule over the heads (jaxformer.recurrent.gated_delta), a
gated RMSNorm by silu(z), and the output projection."""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from jaxformer.core.validation import ConfigError, Section, check_number


@dataclasses.dataclass(frozen=True)
class GatedDeltaSettings(Section):
    """model.mixer.gated_delta. heads: the value heads (HF linear_num_value_heads);
    key_heads: the query/key heads (linear_num_key_heads; None: heads), each shared by
    heads / key_heads value heads; key_dim, value_dim: a head's widths; conv: the short
    convolution's taps; chunk: the chunked form's chunk length (training and prefill)."""

    heads: int = 4
    key_heads: int | None = None
    key_dim: int = 64
    value_dim: int = 64
    conv: int = 4
    chunk: int = 64

    SECTION = "model.mixer.gated_delta"

    def __post_init__(self):
        for name in ("heads", "key_dim", "value_dim", "conv", "chunk"):
            check_number(self.SECTION, name, getattr(self, name), int, low=1)
        check_number(self.SECTION, "key_heads", self.key_heads, int, low=1, optional=True)
        if self.heads % (self.key_heads or self.heads):
            raise ConfigError(f"{self.SECTION}.heads={self.heads} must be a multiple of "
                              f"key_heads={self.key_heads}")

    @property
    def n_key_heads(self) -> int:
        return self.key_heads or self.heads

    @property
    def conv_channels(self) -> int:
        """q, k and v side by side, as the convolution sees them."""
        return 2 * self.n_key_heads * self.key_dim + self.heads * self.value_dim


def cache_shapes(cfg, s: GatedDeltaSettings):
    """One row's cache: the state [heads, key_dim, value_dim] (float32) and the
    convolution's last conv - 1 inputs [conv - 1, channels]."""
    import jax.numpy as jnp
    return {"state": ((s.heads, s.key_dim, s.value_dim), jnp.float32),
            "conv": ((s.conv - 1, s.conv_channels), None)}


class GatedDeltaMixer(nn.Module):
    """(written with the math: jaxformer.recurrent.gated_delta)"""

    cfg: object
    settings: GatedDeltaSettings

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None):
        raise NotImplementedError("model.layer_kinds.<kind>.mixer=gated_delta is not built yet")
