"""The KV cache: its layout, made, written and read in this one module.

A cache is a pytree: ``layers`` laid out like the params, per layer (``block_i``) or
stacked along a leading layer axis (``blocks``, with scan_layers), each holding ``k`` and
``v`` [batch * n_kv_heads, max_len, head_dim] (row b * n_kv_heads + h: batch row b's head
h); ``positions`` [batch, max_len], the position of the token in each slot (EMPTY_SLOT for
none, e.g. a prompt's padding); and ``index``, the next slot to write. Every row writes
its next token into the same slot, so rows with prompts of different lengths decode
together, each at its own positions, and the cache is updated in place.

One row axis, not [B, K, S, H]: at batch 1 XLA drops the size-1 batch axis from the
matmuls, and the reshape that then sits between the in-place cache update and the matmul
made XLA:CPU copy each layer's K four times and transpose V on every decode step
(bench/decode.py, batch 1: ~0.45 -> ~0.2 ms per token). B * K == 1 (MQA at batch 1) still
collapses, and still copies. [B, S, K, H] transposes the cache at every batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.reference import scale_and_mask, softmax
from jaxformer.sharding import constrain

EMPTY_SLOT = 2**30  # the position of a cache slot holding nothing: later than any query


def kv_cache_bytes(cfg, batch: int, seq_len: int, dtype=None) -> int:
    """2 (K and V) * layers * kv_heads * head_dim * seq_len * bytes per value, per batch row."""
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * seq_len * itemsize * batch


def init_cache(cfg, batch: int, max_len: int, dtype=None):
    """An empty cache for `batch` rows of up to `max_len` tokens."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (batch * cfg.n_kv_heads, max_len, cfg.head_dim)
    if cfg.scan_layers:
        layers = {"blocks": {"k": jnp.zeros((cfg.n_layers, *shape), dtype),
                             "v": jnp.zeros((cfg.n_layers, *shape), dtype)}}
    else:
        layers = {f"block_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                  for i in range(cfg.n_layers)}
    return {"layers": layers, "positions": jnp.full((batch, max_len), EMPTY_SLOT, jnp.int32),
            "index": jnp.zeros([], jnp.int32)}


def key_positions(cache, positions, segment_ids):
    """The cache's slot positions [B, S] with the new tokens' written at its index
    (padding, segment id 0, as EMPTY_SLOT: never attended to)."""
    new = positions if segment_ids is None else jnp.where(segment_ids != 0, positions,
                                                          EMPTY_SLOT)
    return jax.lax.dynamic_update_slice(cache["positions"], new, (0, cache["index"]))


def advanced(cache, layers, k_positions, t: int):
    """The cache after t tokens: their layers' keys/values and slot positions written."""
    return {"layers": layers, "positions": k_positions, "index": cache["index"] + t}


def write_layer(layer, k, v, index):
    """A layer's cache with k, v [B, T, K, H] written at slots [index, index + T) (the
    caller keeps that within S: dynamic_update_slice clamps, it does not grow); sharded as
    [B, K, S, H], rows over batch, then heads."""
    b, t, n_kv, h = k.shape

    def update(cache, new):
        cache = jax.lax.dynamic_update_slice(
            cache, jnp.swapaxes(new, 1, 2).reshape(b * n_kv, t, h).astype(cache.dtype),
            (0, index, 0))
        return constrain(cache.reshape(b, n_kv, -1, h), "act_batch", "act_kv_heads",
                         "act_seq", "head_dim").reshape(cache.shape)

    return {"k": update(layer["k"], k), "v": update(layer["v"], v)}


def as_keys(x, batch: int):
    """A layer's k or v [B * K, S, H] as [B, S, K, H], the layout every backend reads."""
    rows, s, h = x.shape
    return x.reshape(batch, rows // batch, s, h).swapaxes(1, 2)


def cached_attention(q, k, v, *, mask=None, bias=None):
    """Attention of q [B, T, N, H] over a layer's cache k, v [B * K, S, H] (a decode
    step): one row of slots per (batch row, K/V head), batch-major."""
    b, t, n, h = q.shape
    rows, s, _ = k.shape
    n_kv = rows // b
    g = n // n_kv
    q = q.reshape(b, t, n_kv, g, h).transpose(0, 2, 3, 1, 4).reshape(rows, g * t, h)
    logits = jnp.einsum("rqh,rsh->rqs", q, k, preferred_element_type=jnp.float32)
    logits = scale_and_mask(logits.reshape(b, n_kv, g, t, s), mask=mask, bias=bias,
                            scale=1.0 / math.sqrt(h))
    w = softmax(logits).reshape(rows, g * t, s)
    out = jnp.einsum("rqs,rsh->rqh", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, n_kv, g, t, h).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)
