"""The bias schemes, a logit bias per head shared by every layer: ALiBi, T5's buckets,
FIRE, KERPLE (log), Sandwich and ALiBi on a power of the distance (alibi_power), each entry beside its math (the formulas themselves are
jaxformer.positions.formulas') and its settings. A bias function is hashable by value
(a module-level function, or a frozen dataclass of its static settings): blockwise
attention takes it as a static argument."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.core.sharding import init_with_names
from jaxformer.core.validation import ConfigError, check_number
from jaxformer.positions.formulas import (FIRE_THRESHOLD, alibi_bias, alibi_slopes, fire_distance,
                                          kerple_bias, sandwich_bias, sandwich_slopes, t5_bias)
from jaxformer.positions.scheme import OWNER, LogitBias, PositionScheme, PositionSettings


def _alibi(module, cfg):
    return LogitBias(alibi_bias, jnp.asarray(alibi_slopes(cfg.n_heads), jnp.float32))


# ---- T5 ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class T5Settings(PositionSettings):
    """num_buckets, max_distance: T5's relative-position buckets (the first half exact
    distances, the rest log-spaced up to max_distance; an encoder's halves for each side)."""

    num_buckets: int = 32
    max_distance: int = 128

    LEGACY: ClassVar = {"t5_num_buckets": "num_buckets", "t5_max_distance": "max_distance"}

    def __post_init__(self):
        check_number(OWNER, "num_buckets", self.num_buckets, int, low=4)
        check_number(OWNER, "max_distance", self.max_distance, int, low=1)
        if self.max_distance <= self.num_buckets // 2:
            raise ConfigError(f"{OWNER}.max_distance={self.max_distance} must exceed half of "
                              f"{OWNER}.num_buckets={self.num_buckets}: the first half of the "
                              "buckets are exact distances, the rest log-spaced up to max_distance")


@dataclasses.dataclass(frozen=True)
class _T5Bias:
    max_distance: int
    bidirectional: bool = False  # an encoder's buckets: half for keys after the query

    def __call__(self, table, q_positions, k_positions):
        return t5_bias(table, q_positions, k_positions, max_distance=self.max_distance,
                       bidirectional=self.bidirectional)


def _t5(module, cfg):
    s = cfg.position_settings
    table = module.param("relative_bias", init_with_names(nn.initializers.normal(0.02), "table",
                                                          "heads"),
                         (s.num_buckets, cfg.n_heads), cfg.param_dtype)
    return LogitBias(_T5Bias(s.max_distance, bidirectional=not cfg.causal), table)


# ---- Sandwich, KERPLE ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SandwichBias:
    dims: int

    def __call__(self, slopes, q_positions, k_positions):
        return sandwich_bias(slopes, q_positions, k_positions, dims=self.dims)


def _sandwich(module, cfg):
    """Sandwich over head_dim dimensions (the d' of NeMo's implementation)."""
    return LogitBias(_SandwichBias(cfg.head_dim), jnp.asarray(sandwich_slopes(cfg.n_heads),
                                                              jnp.float32))


def _kerple(module, cfg):
    """KERPLE-log's r1 ~ U(0, 2) and r2 ~ U(0, 1) per head (the reference code's init)."""
    def uniform(high):
        return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, 0.0, high)
    param = lambda name, high: module.param(  # noqa: E731
        name, init_with_names(uniform(high), "heads"), (cfg.n_heads,), jnp.float32)
    return LogitBias(_kerple_bias, {"r1": param("r1", 2.0), "r2": param("r2", 1.0)})


def _kerple_bias(p, q_positions, k_positions):
    return kerple_bias(p["r1"], p["r2"], q_positions, k_positions)


# ---- FIRE ----------------------------------------------------------------------------

FIRE_WIDTH = 32  # FIRE's hidden layer


def _fire(module, cfg):
    """FIRE's bias, with the reference code's settings: an MLP 1 -> 32 -> heads (ReLU),
    c initialised at 0.1, the threshold at FIRE_THRESHOLD (learned as a multiple of it)."""
    param = lambda name, init, shape, *names, dtype=cfg.param_dtype: module.param(  # noqa: E731
        name, init_with_names(init, *names), shape, dtype)
    return LogitBias(fire_bias, {
        "c": param("c", nn.initializers.constant(0.1), (), dtype=jnp.float32),
        "threshold_scale": param("threshold_scale", nn.initializers.ones, (), dtype=jnp.float32),
        "hidden_kernel": param("hidden_kernel", nn.initializers.normal(1.0), (FIRE_WIDTH,),
                               "pos_mlp"),
        "hidden_bias": param("hidden_bias", nn.initializers.zeros, (FIRE_WIDTH,), "pos_mlp"),
        "out_kernel": param("out_kernel", nn.initializers.lecun_normal(),
                            (FIRE_WIDTH, cfg.n_heads), "pos_mlp", "heads"),
        "out_bias": param("out_bias", nn.initializers.zeros, (cfg.n_heads,), "heads")})


def fire_bias(p, q_positions, k_positions):
    """FIRE's logit bias from its params `p`: [B, N, Tq, Tk] float32."""
    f32 = lambda name: p[name].astype(jnp.float32)  # noqa: E731
    x = fire_distance(q_positions, k_positions, p["c"],
                      jnp.abs(p["threshold_scale"] * FIRE_THRESHOLD))[..., None]
    h = nn.relu(x * f32("hidden_kernel") + f32("hidden_bias"))  # [B, T, S, W]
    return jnp.einsum("btsw,wn->bnts", h, f32("out_kernel")) + f32("out_bias")[:, None, None]


# ---- ALiBi with a power of the distance --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AlibiPowerSettings(PositionSettings):
    """power: p of the bias -m_h |i - j|^p, 0 < p <= 2 (KERPLE's power kernel, Chi et al.
    2022, with ALiBi's fixed slopes m_h in place of learned ones; p = 1 is ALiBi, p < 1
    penalises far keys less, p = 2 a Gaussian window). Default 0.5."""

    power: float = 0.5

    def __post_init__(self):
        check_number(OWNER, "power", self.power, float, low=0, low_open=True, high=2)


def alibi_power_bias(slopes, q_positions, k_positions, power: float):
    """-m_h |i - j|^power: [batch, heads, q_len, k_len] float32. slopes: [heads] (ALiBi's);
    q_positions [batch, q_len], k_positions [batch, k_len]."""
    distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * (distance ** power)[:, None]


@dataclasses.dataclass(frozen=True)
class _PowerBias:
    power: float

    def __call__(self, slopes, q_positions, k_positions):
        return alibi_power_bias(slopes, q_positions, k_positions, self.power)


def _alibi_power(module, cfg):
    return LogitBias(_PowerBias(float(cfg.position_settings.power)),
                     jnp.asarray(alibi_slopes(cfg.n_heads), jnp.float32))


SCHEMES = (
    PositionScheme("alibi", "bias", bias=_alibi),
    PositionScheme("t5", "bias", bias=_t5, settings=T5Settings),
    PositionScheme("fire", "bias", bias=_fire),
    PositionScheme("kerple", "bias", bias=_kerple),
    PositionScheme("sandwich", "bias", bias=_sandwich),
    PositionScheme("alibi_power", "bias", bias=_alibi_power, settings=AlibiPowerSettings),
)
