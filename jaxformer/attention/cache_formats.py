"""The formats a KV cache holds its keys and values in (jaxformer.attention.kv_cache): a
float dtype, or int8 with scales. A format is chosen once, by name (CACHE_FORMATS), when
the cache is made; its entries then carry it: a float cache's ``k`` / ``v`` are arrays, an
int8 cache's are Quantised pairs, and every write (encoded) and read (``.astype``) goes by
what the entry is.

int8: each token's key (and value) in each cache row (a batch row's K/V head; MLA: its one
row, the latent or the rope key) is stored as q = clip(round(x / s), -127, 127), int8, with
one float32 scale s = absmax(x) / 127 over its width (symmetric; s = 0 for a zero vector),
and read back as q * s. So the scales are per (row, slot): per token and per head. Per token,
because a new token is then written without re-quantising the slots already held (a scale
shared by a head's slots would change as larger values arrive); per head, because heads'
ranges differ. Bytes per (row, slot): k's width + v's width (one byte each) + 8 (two float32
scales), against 2 * (k's width + v's width) in bf16: at head_dim H, (2H + 8) / 4H = 1/2 + 2/H
of bf16's (0.53125 at H = 64, 0.515625 at H = 128).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

INT8_MAX = 127  # symmetric: -127 .. 127 (-128 unused, so that -q is always held)
SCALE_DTYPE = jnp.float32


class Quantised(NamedTuple):
    """A cache entry held in int8: values [..., S, H] int8 and scale [..., S, 1] float32,
    the entry being values * scale. A pytree: the cache's take, scan and vmap carry both."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The entry's shape (its values')."""
        return self.values.shape

    def astype(self, dtype):
        """The entry dequantised to `dtype` (what attention reads)."""
        return dequantised(self, dtype)


def int8_scale(x):
    """absmax(x) / 127 over x's last axis [..., H] -> [..., 1] float32."""
    return jnp.max(jnp.abs(x.astype(SCALE_DTYPE)), axis=-1, keepdims=True) / INT8_MAX


def int8_values(x, scale):
    """x [..., H] / scale [..., 1], rounded half to even and clipped to [-127, 127], as
    int8 (a zero scale: zeros)."""
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.round(x.astype(SCALE_DTYPE) / safe)
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def quantised(x) -> Quantised:
    """x [..., H] as int8 values and per-vector scales (symmetric, absmax / 127)."""
    scale = int8_scale(x)
    return Quantised(int8_values(x, scale), scale)


def dequantised(entry: Quantised, dtype=jnp.float32):
    """values * scale [..., H], computed in float32, as dtype."""
    return (entry.values.astype(SCALE_DTYPE) * entry.scale).astype(dtype)


def encoded(entry, new):
    """New keys or values `new` [..., H] in the format of the cache entry they go into:
    Quantised for a Quantised entry, else cast to the entry's dtype."""
    if isinstance(entry, Quantised):
        return quantised(new)
    return new.astype(entry.dtype)


class CacheFormat(NamedTuple):
    """One entry of CACHE_FORMATS: how keys and values are stored."""

    dtype: str          # the stored values' dtype
    scale_bytes: int    # bytes of scale per (row, slot) and entry (k, v); 0: no scales

    def empty(self, shape):
        """A zero entry of `shape` [..., S, H]."""
        if self.scale_bytes:
            return Quantised(jnp.zeros(shape, self.dtype),
                             jnp.zeros((*shape[:-1], 1), SCALE_DTYPE))
        return jnp.zeros(shape, self.dtype)

    def state_dtype(self, default):
        """The dtype of a recurrent layer's entries (no scales there): this format's
        float dtype, or `default` (the model's) for a quantised one."""
        return jnp.dtype(default) if self.scale_bytes else jnp.dtype(self.dtype)

    def entry_bytes(self, width: int) -> int:
        """Bytes one (row, slot) of an entry of `width` numbers takes."""
        return width * jnp.dtype(self.dtype).itemsize + self.scale_bytes


CACHE_FORMATS = {
    "float32": CacheFormat("float32", 0),
    "bfloat16": CacheFormat("bfloat16", 0),
    "float16": CacheFormat("float16", 0),
    "int8": CacheFormat("int8", jnp.dtype(SCALE_DTYPE).itemsize),
}


def cache_format_name(dtype) -> str:
    """A cache dtype (a name or a dtype: "int8", jnp.bfloat16, "bf16") as its
    CACHE_FORMATS name; anything else refused in one line naming the choices."""
    name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    try:
        name = jnp.dtype(name).name
    except TypeError:
        name = str(dtype)
    if name not in CACHE_FORMATS:
        raise ValueError(f"cache_dtype={dtype!r} is not a KV cache format; choose one of "
                         f"{', '.join(CACHE_FORMATS)}")
    return name


def cache_format(dtype) -> CacheFormat:
    """The CacheFormat of a cache dtype (cache_format_name)."""
    return CACHE_FORMATS[cache_format_name(dtype)]
