"""The gated delta rule layer (Gated DeltaNet, Yang et al. 2024) as Qwen3-Next and Qwen3.5
write it: q, k, v from the input through a short causal convolution and SiLU, q and k
L2-normalised, per-head decay g = -exp(A_log) softplus(a + dt_bias) and write strength
beta = sigmoid(b), the delta rule over the heads (jaxformer.recurrent.gated_delta), a
gated RMSNorm by silu(z), and the output projection."""

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
from jaxformer.recurrent.gated_delta import gated_delta_chunked, gated_delta_recurrent

L2_EPS = 1e-6  # q and k: x / sqrt(sum(x^2) + eps), as the FLA kernels


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
    RUNTIME = ("chunk",)  # how it runs, not what it computes

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
    return {"state": ((s.heads, s.key_dim, s.value_dim), jnp.float32),
            "conv": ((s.conv - 1, s.conv_channels), None)}


def flops(cfg, s: GatedDeltaSettings, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward: 3x the forward): 6 per weight of the
    projections (q, k, v, z, b, a, out), and 3x the rule's forward per head in its chunked
    form: the state read by q and by k and written by k, v (6 Dk Dv), and the chunk's
    causal products of queries and keys with keys and values (2 chunk (Dk + Dv)); the
    convolution's 2 conv per channel."""
    weights = cfg.d_model * (2 * s.n_key_heads * s.key_dim + 2 * s.heads * s.value_dim
                             + 2 * s.heads) + s.heads * s.value_dim * cfg.d_model
    rule = s.heads * (6 * s.key_dim * s.value_dim + 2 * min(s.chunk, seq_len)
                      * (s.key_dim + s.value_dim))
    return 6.0 * weights + 3.0 * (rule + 2 * s.conv * s.conv_channels)


def heads_projection(cfg, shape, names, name: str, axis=(-1,), std: float = 0.02):
    """A bias-free DenseGeneral over `axis` to `shape`, its kernel's logical axes `names`,
    in the model's dtypes."""
    return nn.DenseGeneral(shape, axis=axis, use_bias=False, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype,
                           kernel_init=init_with_names(nn.initializers.normal(std), *names),
                           dot_general=projection_dot(cfg.matmul_precision),
                           promote_dtype=promote_kernel, name=name)


def l2_normalize(x):
    """x [..., Dk] / its L2 norm (with L2_EPS), in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gated_rms_norm(o, z, scale, eps: float):
    """rmsnorm(o) * scale * silu(z) over the last axis: o, z [..., Dv], scale [Dv];
    statistics and gate in float32, the result in o's dtype."""
    h = o.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * scale.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def decay_and_write(a, b, a_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) (float32) and beta = sigmoid(b), [B, T, H]."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


class GatedDeltaMixer(nn.Module):
    """Params: query, key [D, key_heads, key_dim], value, z [D, heads, value_dim], b, a
    [D, heads] (HF's in_proj_qkvz / in_proj_ba or in_proj_qkv, z, b, a), conv [K, C] over
    q | k | v (C = conv_channels), A_log, dt_bias [heads], norm_scale [value_dim] (the gated
    RMSNorm's weight, eps cfg.norm_eps), out [heads, value_dim, D]. Hooks: hook_conv_in and
    hook_conv_out (q | k | v [B, T, C] before and after the convolution, before the SiLU),
    hook_decay (g) and hook_write (beta) [B, T, heads], hook_state (the state after the
    call [B, heads, key_dim, value_dim])."""

    cfg: object
    settings: GatedDeltaSettings

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None):  # x [B, T, D]
        c, s = self.cfg, self.settings
        kh, h = s.n_key_heads, s.heads
        key_names, value_names = ("embed", "kv_heads", "state"), ("embed", "heads", "head_dim")
        q = heads_projection(c, (kh, s.key_dim), key_names, "query")(x)  # [B, T, Kh, Dk]
        k = heads_projection(c, (kh, s.key_dim), key_names, "key")(x)  # [B, T, Kh, Dk]
        v = heads_projection(c, (h, s.value_dim), value_names, "value")(x)  # [B, T, H, Dv]
        z = heads_projection(c, (h, s.value_dim), value_names, "z")(x)  # [B, T, H, Dv]
        b = heads_projection(c, h, ("embed", "heads"), "b")(x)  # [B, T, H]
        a = heads_projection(c, h, ("embed", "heads"), "a")(x)  # [B, T, H]
        q, k, v, tail = self.convolved(q, k, v, segment_ids, cache)
        state = None if cache is None else cache["state"]
        o, state = self.delta_rule(q, k, v, a, b, segment_ids, state)  # o [B, T, H, Dv]
        scale = self.param("norm_scale", init_with_names(nn.initializers.ones, "head_dim"),
                           (s.value_dim,), c.param_dtype)
        o = constrain(gated_rms_norm(o, z, scale, c.norm_eps),
                      "act_batch", "act_seq", "act_heads", "head_dim")
        out = heads_projection(c, c.d_model, ("heads", "head_dim", "embed"), "out", (-2, -1),
                               0.02 / math.sqrt(2 * c.n_layers))(o)  # [B, T, D]
        if cache is None:
            return out
        return out, {"state": state.astype(cache["state"].dtype),
                     "conv": tail.astype(cache["conv"].dtype)}

    def convolved(self, q, k, v, segment_ids, cache):
        """q, k [B, T, Kh, Dk] and v [B, T, H, Dv] through the causal convolution over their
        channels side by side, then SiLU; and the convolution's new tail [B, K - 1, C]."""
        c, s = self.cfg, self.settings
        b, t = q.shape[:2]
        w = self.param("conv", init_with_names(nn.initializers.normal(0.1), "conv_taps", None),
                       (s.conv, s.conv_channels), c.param_dtype)
        mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1),
                                 v.reshape(b, t, -1)], axis=-1)  # [B, T, C]
        mixed = hook_point(self, "hook_conv_in", mixed)
        y, tail = causal_conv(mixed, w.astype(mixed.dtype), None, segment_ids,
                              None if cache is None else cache["conv"])
        y = jax.nn.silu(hook_point(self, "hook_conv_out", y))  # [B, T, C]
        width = s.n_key_heads * s.key_dim
        q, k, v = jnp.split(y, [width, 2 * width], axis=-1)
        return (q.reshape(b, t, s.n_key_heads, s.key_dim),
                k.reshape(b, t, s.n_key_heads, s.key_dim),
                v.reshape(b, t, s.heads, s.value_dim), tail)

    def delta_rule(self, q, k, v, a, b, segment_ids, state):
        """The gated delta rule's output [B, T, H, Dv] and final state: q and k
        L2-normalised, q scaled by key_dim ** -0.5, each key head repeated to its value
        heads; chunked over a sequence, step by step for one token."""
        s = self.settings
        a_log = self.param("A_log", init_with_names(
            lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1, 16)),
            "heads"), (s.heads,), self.cfg.param_dtype)
        dt_bias = self.param("dt_bias", init_with_names(nn.initializers.ones, "heads"),
                             (s.heads,), self.cfg.param_dtype)
        g, beta = decay_and_write(a, b, a_log, dt_bias)
        g, beta = hook_point(self, "hook_decay", g), hook_point(self, "hook_write", beta)
        groups = s.heads // s.n_key_heads  # value heads per key head, adjacent
        q = jnp.repeat(l2_normalize(q) * s.key_dim ** -0.5, groups, axis=2)  # [B, T, H, Dk]
        k = jnp.repeat(l2_normalize(k), groups, axis=2)  # [B, T, H, Dk]
        if q.shape[1] == 1 and state is not None:
            o, state = gated_delta_recurrent(q, k, v, g, beta, segment_ids, state)
        else:
            o, state = gated_delta_chunked(q, k, v, g, beta, segment_ids, state, s.chunk)
        return o, hook_point(self, "hook_state", state)
