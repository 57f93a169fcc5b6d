"""Norms: LayerNorm, RMSNorm and RMSNorm scaled by 1 + w (model.norm), over the last axis
or several (QK-norm over a whole projection), with TransformerLens's hook_normalized."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.core.hooks import active, hook_point
from jaxformer.core.sharding import init_with_names
from jaxformer.model.config import ModelConfig
from jaxformer.model.kinds import NORMS


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (offset + scale), the statistics and the product in float32, the scale
    initialised at 0 (Gemma's RMSNorm: offset 1); over the trailing axes the scale has."""

    epsilon: float
    dtype: Any
    param_dtype: Any
    scale_init: Callable
    offset: float = 1.0
    axes: int = 1

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", self.scale_init, x.shape[-self.axes:], self.param_dtype)
        y = rms_normalize(x, self.epsilon, tuple(range(-self.axes, 0)))
        return (y * (self.offset + scale.astype(jnp.float32))).astype(self.dtype)


def make_norm(cfg: ModelConfig, name: str, names=("norm",)) -> nn.Module:
    """The model's norm (LayerNorm with a bias if use_bias, RMSNorm, or RMSNorm scaled by
    1 + w) over the trailing len(names) axes, its scale's logical axes `names`;
    statistics in float32."""
    axes, kind = tuple(range(-len(names), 0)), NORMS[cfg.norm]
    common = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    if kind.scale_offset:
        return OffsetRMSNorm(scale_init=init_with_names(nn.initializers.zeros, *names),
                             offset=kind.scale_offset, axes=len(names), **common)
    scale = init_with_names(nn.initializers.ones, *names)
    if kind.rms:
        return nn.RMSNorm(scale_init=scale, reduction_axes=axes, feature_axes=axes, **common)
    return nn.LayerNorm(use_bias=cfg.use_bias, use_fast_variance=False, scale_init=scale,
                        bias_init=init_with_names(nn.initializers.zeros, *names),
                        reduction_axes=axes, feature_axes=axes, **common)


def rms_normalize(x, eps: float, axes=(-1,)):
    """x / rms(x) over `axes`, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


def normalize(cfg: ModelConfig, x, axes=(-1,)):
    """x [..., D] normalised in float32 over `axes`, before the norm's scale and bias:
    (x - mean) / std for LayerNorm, x / rms for the RMSNorms."""
    if NORMS[cfg.norm].rms:
        return rms_normalize(x, cfg.norm_eps, axes)
    x = x.astype(jnp.float32)
    centred = x - jnp.mean(x, axis=axes, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=axes, keepdims=True)
                                   + cfg.norm_eps)


def scale_and_shift(cfg: ModelConfig, p, h):
    """The normalised h [..., D] (float32) times a norm's scale (1 + scale for
    rmsnorm_offset) plus its bias, if any, read from its params `p`: float32."""
    scale = p["scale"].astype(jnp.float32) + NORMS[cfg.norm].scale_offset
    h = h * scale
    return h + p["bias"].astype(jnp.float32) if "bias" in p else h


def apply_norm(cfg: ModelConfig, norm: nn.Module, x):
    """norm(x). When jaxformer.model.inspect reads or hooks its `hook_normalized` (the normalised
    x before the scale and bias, float32, as TransformerLens has it), the norm is computed
    here from its params, around that hook point."""
    y = norm(x)
    if not active(norm, "hook_normalized"):
        return y
    p = norm.variables["params"]
    axes = tuple(range(-p["scale"].ndim, 0))
    h = hook_point(norm, "hook_normalized", normalize(cfg, x, axes))
    return scale_and_shift(cfg, p, h).astype(y.dtype)
