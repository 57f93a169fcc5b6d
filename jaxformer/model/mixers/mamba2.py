"""Mamba-2's layer (Dao and Gu 2024) as transformers' Mamba2Mixer writes it: z, x, B, C
and dt from one input projection, a short causal convolution and SiLU over x, B and C,
the SSD recurrence over the heads (jaxformer.recurrent.ssd) with the D skip, a gated
RMSNorm by silu(z) (per group), and the output projection."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.core.hooks import hook_point
from jaxformer.core.matmul import projection_dot, promote_kernel
from jaxformer.core.sharding import constrain, init_with_names
from jaxformer.core.validation import ConfigError, Section, check_number
from jaxformer.recurrent.conv import causal_conv
from jaxformer.recurrent.ssd import ssd_chunked, ssd_recurrent


@dataclasses.dataclass(frozen=True)
class Mamba2Settings(Section):
    """model.mixer.mamba2. heads, head_dim: the SSD heads (d_inner = heads * head_dim);
    groups: B and C's groups (n_groups); state: the state's width N (d_state / state_size);
    conv: the convolution's taps; chunk: the chunked form's length; conv_bias, bias: biases
    on the convolution and on the in/out projections; dt_min, dt_max, dt_floor: the step's
    initial range (dt_bias's init); dt_limit_low, dt_limit_high: the step clamped to
    [low, high] (high None: no limit; HF's time_step_limit, Nemotron-H's (time_step_min,
    inf)), in the chunked form and the one-token step alike (transformers' torch step
    does not clamp). The gated norm's groups are B and C's (heads / groups heads each).
    The norm's epsilon is the model's norm_eps. norm: the gated RMSNorm (false: y * silu(z),
    no norm and no norm weight: Falcon-H1's mamba_rms_norm=false); norm_before_gate: the
    norm of y, then times silu(z) (Falcon-H1's mamba_norm_before_gate), else of y * silu(z).
    out_bias: a bias on the out projection (None: as bias; Falcon-H1's projectors_bias
    beside its mamba_proj_bias on in_proj). in_multiplier, out_multiplier: the input and
    the output scaled (Falcon-H1's ssm_in/out_multiplier); part_multipliers: z, x, B, C and
    dt each scaled after the in projection (its ssm_multipliers)."""

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
    norm: bool = True
    norm_before_gate: bool = False
    out_bias: bool | None = None
    in_multiplier: float = 1.0
    out_multiplier: float = 1.0
    part_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)

    SECTION = "model.mixer.mamba2"
    RUNTIME = ("chunk",)  # how it runs, not what it computes

    def __post_init__(self):
        for name in ("heads", "head_dim", "groups", "state", "conv", "chunk"):
            check_number(self.SECTION, name, getattr(self, name), int, low=1)
        check_number(self.SECTION, "dt_limit_low", self.dt_limit_low, float, low=0)
        check_number(self.SECTION, "dt_limit_high", self.dt_limit_high, float,
                     low=self.dt_limit_low, optional=True)
        parts = self.part_multipliers
        if isinstance(parts, str):  # 'z,x,b,c,dt' from the command line
            parts = [p for p in parts.split(",") if p.strip()]
        try:
            parts = tuple(float(p) for p in parts)
        except (TypeError, ValueError):
            parts = ()
        if len(parts) != 5:
            raise ConfigError(f"{self.SECTION}.part_multipliers={self.part_multipliers!r} must "
                              "be five numbers: z, x, B, C and dt's")
        object.__setattr__(self, "part_multipliers", parts)
        for name in ("in_multiplier", "out_multiplier"):
            check_number(self.SECTION, name, getattr(self, name), float)
        if self.heads % self.groups:
            raise ConfigError(f"{self.SECTION}.heads={self.heads} must be a multiple of "
                              f"groups={self.groups}")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def out_biased(self) -> bool:
        """Whether the out projection has a bias (out_bias, else bias)."""
        return self.bias if self.out_bias is None else self.out_bias

    @property
    def conv_channels(self) -> int:
        """x, B and C side by side, as the convolution sees them."""
        return self.inner + 2 * self.groups * self.state


def cache_shapes(cfg, s: Mamba2Settings):
    """One row's cache: the state [heads, head_dim, state] (float32) and the convolution's
    last conv - 1 inputs [conv - 1, channels]."""
    return {"state": ((s.heads, s.head_dim, s.state), jnp.float32),
            "conv": ((s.conv - 1, s.conv_channels), None)}


def flops(cfg, s: Mamba2Settings, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward: 3x the forward): 6 per weight of the
    projections (z, x, B, C, dt in; out), and 3x SSD's forward per head in its chunked
    form: the state written and read (6 P N: the decay, x B^T, C S), and the chunk's
    causal products C B^T and their weighted sum of x (chunk (N + P)); the convolution's 2
    conv per channel."""
    weights = cfg.d_model * (2 * s.inner + 2 * s.groups * s.state + s.heads) + \
        s.inner * cfg.d_model
    ssd = s.heads * (6 * s.head_dim * s.state + min(s.chunk, seq_len) * (s.state + s.head_dim))
    return 6.0 * weights + 3.0 * (ssd + 2 * s.conv * s.conv_channels)


def heads_projection(cfg, shape, names, name: str, bias: bool, axis=(-1,), std: float = 0.02):
    """A DenseGeneral over `axis` to `shape`, its kernel's logical axes `names` (the bias's
    the output ones), in the model's dtypes."""
    return nn.DenseGeneral(shape, axis=axis, use_bias=bias, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype,
                           kernel_init=init_with_names(nn.initializers.normal(std), *names),
                           bias_init=init_with_names(nn.initializers.zeros,
                                                     *names[len(axis):]),
                           dot_general=projection_dot(cfg.matmul_precision),
                           promote_dtype=promote_kernel, name=name)


def dt_bias_init(s: Mamba2Settings):
    """HF's dt_bias: the inverse softplus of steps log-uniform in [dt_min, dt_max], at
    least dt_floor."""
    def init(key, shape, dtype):
        u = jax.random.uniform(key, shape, jnp.float32)
        dt = jnp.exp(u * (math.log(s.dt_max) - math.log(s.dt_min)) + math.log(s.dt_min))
        dt = jnp.maximum(dt, s.dt_floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    return init


def a_log_init(key, shape, dtype):
    """A_log = log(1 .. heads): head h decays at rate h + 1 per unit step."""
    return jnp.log(jnp.arange(1, shape[0] + 1, dtype=jnp.float32)).astype(dtype)


def conv_init(key, shape, dtype):
    """torch's Conv1d default (kaiming uniform, a = sqrt(5)): uniform in +-1/sqrt(taps)."""
    bound = 1 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def step_size(dt, dt_bias, s: Mamba2Settings):
    """softplus(dt + dt_bias) clamped to [dt_limit_low, dt_limit_high], float32 [B, T, H]."""
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(dt, s.dt_limit_low, s.dt_limit_high)


def grouped_gated_norm(y, z, scale, groups: int, eps: float, before_gate: bool = False):
    """HF's MambaRMSNormGated: h = y * silu(z) in float32, RMS-normalised over each of
    `groups` runs of heads side by side (heads * head_dim / groups channels), times scale;
    before_gate: y normalised so, then times silu(z) (Falcon-H1's norm_before_gate). scale
    None: no norm, y * silu(z). y, z [B, T, H, P], scale [H, P]; float32 out."""
    gate = jax.nn.silu(z.astype(jnp.float32))  # [B, T, H, P]
    h = y.astype(jnp.float32)
    if scale is None:
        return h * gate
    if not before_gate:
        h = h * gate
    b, t, heads, p = h.shape
    g = h.reshape(b, t, groups, heads // groups * p)  # [B, T, G, H/G * P]
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    h = g.reshape(b, t, heads, p) * scale.astype(jnp.float32)
    return h * gate if before_gate else h


def scaled(x, multiplier: float):
    """x times a multiplier in its dtype (x itself at 1)."""
    return x if multiplier == 1.0 else x * jnp.asarray(multiplier, x.dtype)


class Mamba2Mixer(nn.Module):
    """Params: in_z, in_x [D, heads, head_dim], in_b, in_c [D, groups, state], in_dt
    [D, heads] (HF's in_proj as z | x | B | C | dt; biases where settings.bias), conv
    [K, C] over x | B | C (C = conv_channels; conv_bias where settings.conv_bias), dt_bias,
    A_log, D [heads], norm [heads, head_dim] (the gated RMSNorm's weight, eps cfg.norm_eps;
    where settings.norm),
    out [heads, head_dim, D]. Hooks: hook_conv_in and hook_conv_out (x | B | C [B, T, C]
    before and after the convolution, before the SiLU), hook_dt (the step [B, T, heads],
    after softplus and clamp), hook_state (the state after the call [B, heads, head_dim,
    state])."""

    cfg: object
    settings: Mamba2Settings

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None):  # x [B, T, D]
        c, s = self.cfg, self.settings
        proj = self.projected(scaled(x, s.in_multiplier))
        h, b_, c_, tail = self.convolved(proj["in_x"], proj["in_b"], proj["in_c"], segment_ids,
                                         cache)
        y, state = self.scan(h, proj["in_dt"], b_, c_, segment_ids,
                             None if cache is None else cache["state"])  # [B, T, H, P]
        scale = self.param("norm", init_with_names(nn.initializers.ones, "heads", "head_dim"),
                           (s.heads, s.head_dim), c.param_dtype) if s.norm else None
        y = grouped_gated_norm(y, proj["in_z"], scale, s.groups, c.norm_eps,
                               s.norm_before_gate).astype(c.dtype)
        y = constrain(y, "act_batch", "act_seq", "act_heads", "head_dim")
        out = heads_projection(c, c.d_model, ("heads", "head_dim", "embed"), "out",
                               s.out_biased, (-2, -1), 0.02 / math.sqrt(2 * c.n_layers))(y)
        out = scaled(out, s.out_multiplier)  # [B, T, D]
        if cache is None:
            return out
        return out, {"state": state.astype(cache["state"].dtype),
                     "conv": tail.astype(cache["conv"].dtype)}

    def projected(self, x):
        """z, x [B, T, heads, head_dim], B, C [B, T, groups, state] and dt [B, T, heads]
        from x [B, T, D] (HF's in_proj), each times its part multiplier."""
        c, s = self.cfg, self.settings
        heads, groups = ("embed", "heads", "head_dim"), ("embed", "mixer_groups", "state")
        return {name: scaled(heads_projection(c, shape, names, name, s.bias)(x), m)
                for (name, shape, names), m in zip(
                    (("in_z", (s.heads, s.head_dim), heads),
                     ("in_x", (s.heads, s.head_dim), heads),
                     ("in_b", (s.groups, s.state), groups),
                     ("in_c", (s.groups, s.state), groups),
                     ("in_dt", s.heads, ("embed", "heads"))), s.part_multipliers)}

    def convolved(self, h, b_, c_, segment_ids, cache):
        """x [B, T, H, P], B and C [B, T, G, N] through the causal convolution over their
        channels side by side, then SiLU; and the convolution's new tail [B, K - 1, C]."""
        c, s = self.cfg, self.settings
        bt, t = h.shape[:2]
        w = self.param("conv", init_with_names(conv_init, "conv_taps", None),
                       (s.conv, s.conv_channels), c.param_dtype)
        bias = self.param("conv_bias", init_with_names(nn.initializers.zeros, None),
                          (s.conv_channels,), c.param_dtype) if s.conv_bias else None
        mixed = jnp.concatenate([h.reshape(bt, t, -1), b_.reshape(bt, t, -1),
                                 c_.reshape(bt, t, -1)], axis=-1)  # [B, T, C]
        mixed = hook_point(self, "hook_conv_in", mixed)
        y, tail = causal_conv(mixed, w.astype(mixed.dtype), None if bias is None else
                              bias.astype(mixed.dtype), segment_ids,
                              None if cache is None else cache["conv"])
        y = jax.nn.silu(hook_point(self, "hook_conv_out", y))  # [B, T, C]
        h, b_, c_ = jnp.split(y, [s.inner, s.inner + s.groups * s.state], axis=-1)
        return (h.reshape(bt, t, s.heads, s.head_dim), b_.reshape(bt, t, s.groups, s.state),
                c_.reshape(bt, t, s.groups, s.state), tail)

    def scan(self, h, dt, b_, c_, segment_ids, state):
        """The SSD recurrence with the D skip: y [B, T, H, P] (float32) and the final state
        [B, H, P, N]; chunked over a sequence, step by step for one cached token."""
        s, pd = self.settings, self.cfg.param_dtype
        dt_bias = self.param("dt_bias", init_with_names(dt_bias_init(s), "heads"),
                             (s.heads,), pd)
        a_log = self.param("A_log", init_with_names(a_log_init, "heads"), (s.heads,), pd)
        d_skip = self.param("D", init_with_names(nn.initializers.ones, "heads"), (s.heads,), pd)
        dt = hook_point(self, "hook_dt", step_size(dt, dt_bias, s))  # [B, T, H]
        a = -jnp.exp(a_log.astype(jnp.float32))  # [H]
        if h.shape[1] == 1 and state is not None:
            y, state = ssd_recurrent(h, dt, a, b_, c_, segment_ids, state)
        else:
            y, state = ssd_chunked(h, dt, a, b_, c_, segment_ids, state, s.chunk)
        y = y.astype(jnp.float32) + d_skip.astype(jnp.float32)[:, None] * h.astype(jnp.float32)
        return y, hook_point(self, "hook_state", state)
