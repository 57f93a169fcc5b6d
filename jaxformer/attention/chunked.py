"""The chunked backend: heads-first attention in blocks of query rows, with its backward
pass written out. The fastest backend on XLA:CPU while the logits fit in memory
(bench/attention.py); each block's softmax runs over every key it can see, so the result
is the reference's."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxformer.core.reference import (bias_and_mask, causal_index_mask, check_softcap, exp_rows,
                                      group_sinks, query_groups)

CHUNK = 128  # query rows per block (bench/attention.py)


def _rows(x, start, stop, keys):
    """Query rows [start, stop) and the first `keys` keys of a 4-D mask or bias; size-1
    (broadcast) axes stay whole."""
    if x is None:
        return None
    rows = slice(start, stop) if x.shape[2] > 1 else slice(None)
    return x[:, :, rows, :keys] if x.shape[3] > 1 else x[:, :, rows]


def _blocks(t: int, s: int, is_causal: bool):
    """(first row, end row, keys read) of each block of query rows: with is_causal, blocks
    of CHUNK rows (fewer if T < 2 CHUNK: at least two blocks, so the masked corner is
    skipped) that read the keys up to their last row; else one block over every key.
    Measured (train step, bench shapes, T 128: blocks of 64 rows 3% faster than 128; T 256:
    128 rows, as fast as 64 for GPT-2 and 5% faster for Llama)."""
    if not is_causal:
        return ((0, t, s),)
    rows = min(CHUNK, max(1, t // 2))
    return tuple((a, min(a + rows, t), min(a + rows, t)) for a in range(0, t, rows))


def chunked_attention(q, k, v, *, mask, bias, scale, is_causal, softcap=None, sinks=None):
    """Heads-first attention in blocks of CHUNK query rows; with is_causal a block reads
    only the keys up to its last row, skipping the masked upper triangle's work. softcap:
    the scaled logits s become softcap * tanh(s / softcap) before the bias and the mask.
    sinks [N]: a logit per query head in every row's softmax (jaxformer.core.reference).

    Each block's softmax runs over every key the block can see, so no online rescaling is
    needed and the result is the reference's. On XLA:CPU the [B, K, G, T, H] layout runs
    its batched matmuls ~2x faster than [B, T, N, H]. The backward pass is written out
    (_heads_first_bwd) rather than differentiated through the masked softmax."""
    b, t, n, h = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    qh = q.reshape(b, t, n_kv, query_groups(n, n_kv), h)
    qh = qh.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    out = _heads_first(scale, is_causal, check_softcap(softcap), qh, kh, vh, mask, bias,
                       group_sinks(sinks, n_kv))
    # out: [B, K, G, T, H] float32
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, v.shape[-1]).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _heads_first(scale, is_causal, softcap, q, k, v, mask, bias, sinks):
    """q [B, K, G, T, H], k/v [B, K, S, H], sinks [K, G, 1, 1] or None -> float32
    [B, K, G, T, H], block by block."""
    return _heads_first_fwd(scale, is_causal, softcap, q, k, v, mask, bias, sinks)[0]


def _block_exp(scale, is_causal, softcap, q, k, mask, bias, sinks, start, stop, keys):
    """A block's unnormalised weights e = exp(logits - row max) [B, K, G, rows, keys] (0
    where masked), 1 / their row sums [B, K, G, rows, 1] (0 for a row with no key), with
    a softcap the cap's slope 1 - tanh(s / cap)^2 [B, K, G, rows, keys] (else None), and
    with sinks the sink's weight [B, K, G, rows, 1] (else None)."""
    logits = jnp.einsum("bkgth,bksh->bkgts", q[:, :, :, start:stop], k[:, :, :keys],
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    slope = None
    if softcap is not None:
        cap = jnp.float32(softcap)
        tanh = jnp.tanh(logits / cap)
        logits, slope = cap * tanh, 1.0 - tanh * tanh
    block_mask = _rows(mask, start, stop, keys)
    if is_causal:
        diagonal = causal_index_mask(keys)[:, :, start:stop]
        block_mask = diagonal if block_mask is None else block_mask & diagonal
    logits = bias_and_mask(logits, mask=block_mask, bias=_rows(bias, start, stop, keys))
    e, total, peak = exp_rows(logits, sinks)
    inv = jnp.where(total == 0, 0.0, 1.0 / jnp.where(total == 0, 1.0, total))
    return e, inv, slope, None if sinks is None else jnp.exp(sinks - peak) * inv


def _heads_first_fwd(scale, is_causal, softcap, q, k, v, mask, bias, sinks):
    """Softmax(logits) V as (e V) / rowsum(e): the division touches [rows, H], not the
    [rows, keys] weights, which are never formed. With a softcap each block also keeps
    the cap's slope for the backward (one more [rows, keys] float32 array per block)."""
    outs, saved = [], []
    for start, stop, keys in _blocks(q.shape[3], k.shape[2], is_causal):
        e, inv, slope, sink = _block_exp(scale, is_causal, softcap, q, k, mask, bias, sinks,
                                         start, stop, keys)
        saved.append((e, inv, slope, sink))
        outs.append(jnp.einsum("bkgts,bksh->bkgth", e.astype(v.dtype), v[:, :, :keys],
                               preferred_element_type=jnp.float32) * inv)
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, T, H]
    return out, (q, k, v, mask, bias, sinks, saved, out)


def _heads_first_bwd(scale, is_causal, softcap, res, d_out):
    """With P = e / rowsum(e) a block's weights: dV = P^T dO, dP = dO V^T, and the
    logits' gradient dS = P (dP - rowsum(dO * O)) (the softmax's Jacobian, summed over H
    instead of over the keys); the bias gets dS; with a softcap dS is then multiplied by
    the cap's slope 1 - tanh(s / cap)^2; dQ = scale dS K, dK = scale dS^T Q. A sink is a
    key with a zero value: its logit's gradient is -P_sink rowsum(dO * O), summed.
    P is folded in as e and 1 / rowsum(e): dV = e^T (dO / rowsum(e))."""
    q, k, v, mask, bias, sinks, saved, out = res
    f32 = jnp.float32
    delta = jnp.sum(d_out * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    dbias = None if bias is None else jnp.zeros(bias.shape, f32)
    dsinks = None if sinks is None else jnp.zeros(sinks.shape, f32)
    blocks = _blocks(q.shape[3], k.shape[2], is_causal)
    for (start, stop, keys), (e, inv, slope, sink) in zip(blocks, saved):
        do = d_out[:, :, :, start:stop]  # [B, K, G, rows, H]
        if sinks is not None:
            dsinks = dsinks - jnp.sum(sink * delta[:, :, :, start:stop], axis=(0, 3)).reshape(
                sinks.shape)
        dv = dv.at[:, :, :keys].add(jnp.einsum("bkgts,bkgth->bksh", e.astype(v.dtype),
                                               (do * inv).astype(v.dtype),
                                               preferred_element_type=f32))
        dw = jnp.einsum("bkgth,bksh->bkgts", do.astype(v.dtype), v[:, :, :keys],
                        preferred_element_type=f32)
        ds = e * inv * (dw - delta[:, :, :, start:stop])  # [B, K, G, rows, keys]
        if bias is not None:
            dbias = _add_rows(dbias, ds, start, stop, keys)
        if slope is not None:  # d(cap tanh(s / cap)) / ds
            ds = ds * slope
        ds = (ds * f32(scale)).astype(q.dtype)
        dq.append(jnp.einsum("bkgts,bksh->bkgth", ds, k[:, :, :keys], preferred_element_type=f32))
        dk = dk.at[:, :, :keys].add(jnp.einsum("bkgts,bkgth->bksh", ds, q[:, :, :, start:stop],
                                               preferred_element_type=f32))
    dq = jnp.concatenate(dq, axis=3).astype(q.dtype)
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None,
            None if bias is None else dbias.astype(bias.dtype), dsinks)


_heads_first.defvjp(_heads_first_fwd, _heads_first_bwd)


def _add_rows(total, ds, start, stop, keys):
    """Adds a block's logit gradient ds [B, K, G, rows, keys] into a bias's gradient
    `total` [B|1, N|1, Tq|1, Tk|1], summed over the axes the bias broadcasts along; the
    inverse of _rows."""
    ds = ds.reshape(ds.shape[0], -1, *ds.shape[3:])  # [B, N, rows, keys]
    broadcast = tuple(i for i in range(4) if total.shape[i] == 1 and ds.shape[i] > 1)
    ds = jnp.sum(ds, axis=broadcast, keepdims=True)
    rows = slice(start, stop) if total.shape[2] > 1 else slice(None)
    keys = slice(None, keys) if total.shape[3] > 1 else slice(None)
    return total.at[:, :, rows, keys].add(ds)
