"""The short causal depthwise convolution of the recurrent mixers: each channel c of
y_t = sum_j w[j, c] x_{t - (K - 1) + j}, over the K - 1 inputs before t and x_t itself.

Packing: an input of another segment than x_t's reads as 0 (a segment's first token sees
none before it); a cached `tail` [B, K - 1, C] holds the inputs before the first token
(the last K - 1 real inputs of the sequence so far) and is read as the first token's
segment. Padding (segment id 0) at the end of a row is not written into the new tail.
"""

from __future__ import annotations

import jax.numpy as jnp


def causal_conv(x, w, bias=None, segment_ids=None, tail=None):
    """x [B, T, C], w [K, C] (w[K - 1] multiplies x_t), bias [C] or None; segment_ids
    [B, T] or None; tail [B, K - 1, C] or None (zeros). Returns y [B, T, C] (no activation)
    and the new tail [B, K - 1, C]: the last K - 1 inputs of the real tokens, right-padded
    rows' padding skipped."""
    b, t, c = x.shape
    k = w.shape[0]
    if tail is None:
        tail = jnp.zeros((b, k - 1, c), x.dtype)
    full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    seg = None
    if segment_ids is not None:  # the tail reads as the first token's segment
        seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], k - 1, axis=1), segment_ids], 1)
    y = jnp.zeros((b, t, c), jnp.promote_types(x.dtype, jnp.float32))
    for j in range(k):  # K is small (2-4): one shifted product per tap
        xs = full[:, j:j + t]  # [B, T, C]: x_{t - (K - 1) + j}
        if seg is not None:
            xs = jnp.where((seg[:, j:j + t] == segment_ids)[..., None], xs, 0)
        y = y + xs * w[j]
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), new_tail(full, segment_ids, k)


def new_tail(full, segment_ids, k: int):
    """The last K - 1 real inputs of full [B, K - 1 + T, C] (the old tail, then T new
    inputs, the real ones first in each row)."""
    if segment_ids is None:
        return full[:, full.shape[1] - (k - 1):]
    real = jnp.sum(segment_ids != 0, axis=1)  # [B]
    idx = real[:, None] + jnp.arange(k - 1)  # [B, K - 1]: after the real inputs, K - 1 back
    return jnp.take_along_axis(full, idx[..., None], axis=1)
