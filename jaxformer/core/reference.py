"""Attention's definition: grouped-query logits, the float32 softmax and the weighted
sum, written once and shared by every backend and by inspection (attention patterns).

Layout is [batch, seq, heads, head_dim] for q/k/v (as jax.nn.dot_product_attention and
cuDNN). Boolean masks are [batch, 1, q_len, k_len] (True = may attend) and broadcast over
heads; biases broadcast to [batch, heads, q_len, k_len].

Logits are s = q.k * scale, soft-capped if asked (Gemma 2: cap * tanh(s / cap), before
the bias and the mask), plus the bias, -inf where masked.

Attention sinks (gpt-oss): a learned logit per query head [N] that joins every row's
softmax as one more key with a zero value, so a row may give weight to nothing:
out = sum_j e^{l_j} v_j / (sum_j e^{l_j} + e^{sink}). A row with no key then outputs 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # the reference is the definition: no TF32 on GPUs


def as_4d(x):
    """Left-pad a mask or bias with size-1 axes to [B|1, N|1, Tq, Tk]."""
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def group_heads(x, n_kv_heads: int):
    """[B, N|1, T, S] -> [B, K|1, G|1, T, S], grouping query heads by their K/V head."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], n_kv_heads, x.shape[1] // n_kv_heads, *x.shape[2:])


def query_groups(n_heads: int, n_kv_heads: int) -> int:
    """Query heads per key/value head (GQA)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads "
                         f"({n_kv_heads})")
    return n_heads // n_kv_heads


def grouped_logits(q, k, *, mask, bias, scale, precision=HIGHEST, softcap=None):
    """Float32 logits [B, K, G, Tq, Tk], masked entries -inf. GQA groups the query heads,
    so K/V are never copied per query head. softcap: see scale_and_mask."""
    b, t, n, h = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, query_groups(n, n_kv), h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=precision,
                        preferred_element_type=jnp.float32)
    return scale_and_mask(logits, mask=mask, bias=bias,
                          scale=1.0 / math.sqrt(h) if scale is None else scale, softcap=softcap)


def check_softcap(softcap):
    """A soft-cap as the backends take it: None (no cap), or a positive finite Python
    float (hashable: the custom-gradient backends take it as a static argument)."""
    if softcap is None:
        return None
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"attention softcap must be a positive finite number or None, "
                         f"got {softcap!r}")
    return cap


def soft_cap(scores, softcap):
    """Gemma 2's logit soft-capping, cap * tanh(scores / cap), in float32; scores unchanged
    (no op added) for softcap None. Its derivative is 1 - tanh(scores / cap)^2."""
    if softcap is None:
        return scores
    cap = jnp.float32(softcap)
    return cap * jnp.tanh(scores / cap)


def scale_and_mask(logits, *, mask, bias, scale, softcap=None):
    """logits [B, K, G, Tq, Tk] * scale, soft-capped if softcap (cap * tanh(. / cap)),
    (+ bias), masked entries -inf."""
    logits = soft_cap(logits * jnp.float32(scale), softcap)
    return bias_and_mask(logits, mask=mask, bias=bias)


def bias_and_mask(logits, *, mask, bias):
    """Scaled (and capped) logits [B, K, G, Tq, Tk] + bias, masked entries -inf."""
    n_kv = logits.shape[1]
    if bias is not None:
        logits = logits + group_heads(bias.astype(jnp.float32), n_kv)
    if mask is not None:
        logits = jnp.where(group_heads(mask, n_kv), logits, -jnp.inf)
    return logits


def group_sinks(sinks, n_kv: int):
    """Sinks [N] (one logit per query head) as grouped logits' rows take them: float32
    [K, G, 1, 1]; None stays None."""
    return None if sinks is None else sinks.astype(jnp.float32).reshape(n_kv, -1, 1, 1)


def exp_rows(logits, sinks=None):
    """exp(logits - row max) in float32 (0 where -inf; the max of a row with nothing to
    attend to taken as 0), the row sums [..., 1] and the row max [..., 1]. sinks
    (broadcast to the rows [..., 1]): one more logit per row, in the max and the sums."""
    peak = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks)
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    e = jnp.exp(logits - peak)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e, total if sinks is None else total + jnp.exp(sinks - peak), peak


def softmax(logits, sinks=None):
    """Softmax over the last axis in float32; a row with nothing to attend to gives zeros.
    sinks: one more logit per row (broadcast to [..., 1]) whose weight is dropped."""
    e, total, _ = exp_rows(logits, sinks)
    return e / jnp.where(total == 0, 1.0, total)


def mix(w, v, q, precision=HIGHEST):
    """Weights w [B, K, G, Tq, Tk] applied to v [B, Tk, K, Hv] -> [B, Tq, N, Hv] in q.dtype
    (Hv may differ from q's head_dim: MLA)."""
    out = jnp.einsum("bkgts,bskh->btkgh", w.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(*q.shape[:-1], v.shape[-1]).astype(q.dtype)


def and_causal(mask, t: int):
    """A 4-D mask (or None) and the index-causal mask of t queries over t keys."""
    causal = causal_index_mask(t)
    return causal if mask is None else mask & causal


def attention_weights(q, k, *, mask=None, bias=None, scale=None, softcap=None, sinks=None):
    """Softmax attention weights [B, N, Tq, Tk] in float32 (for inspection and plots);
    with sinks a row sums to 1 minus its sink's weight."""
    w = softmax(grouped_logits(q, k, mask=as_4d(mask), bias=as_4d(bias), scale=scale,
                               softcap=softcap), group_sinks(sinks, k.shape[2]))
    return w.reshape(w.shape[0], -1, *w.shape[3:])  # [B, K, G, T, S] -> [B, N, T, S]


def reference_attention(q, k, v, *, mask, bias, scale, precision=HIGHEST, softcap=None,
                        sinks=None):
    w = softmax(grouped_logits(q, k, mask=mask, bias=bias, scale=scale, precision=precision,
                               softcap=softcap), group_sinks(sinks, k.shape[2]))  # [B, K, G, T, S]
    return mix(w, v, q, precision)  # [B, T, N, H]


def causal_index_mask(t: int):
    """Query i attends to keys 0..i, by index in the row (is_causal). -> [1, 1, T, T]"""
    return jnp.tril(jnp.ones((t, t), bool))[None, None]
