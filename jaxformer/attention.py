"""Attention: masks from positions and segment ids, backends, and the Attention module.

Layout is [batch, seq, heads, head_dim] for q/k/v (as jax.nn.dot_product_attention and
cuDNN). Boolean masks are [batch, 1, q_len, k_len] (True = may attend) and broadcast over
heads; biases broadcast to [batch, heads, q_len, k_len].
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.blockwise import blockwise_attention, index_bias
from jaxformer.config import ATTENTION_IMPLS, ModelConfig
from jaxformer.hooks import active, hook_point
from jaxformer.masks import (MaskRule, causal_mask, make_attention_mask,  # noqa: F401
                             padding_mask, segment_mask, sliding_window_mask)
from jaxformer.matmul import flat_dot_general
from jaxformer.positions import (FIRE_THRESHOLD, alibi_bias, alibi_slopes, apply_rope,
                                 fire_distance, t5_bias)
from jaxformer.sharding import constrain, init_with_names
from jaxformer.splash import splash_attention

IMPLS = ATTENTION_IMPLS  # auto, reference, xla, cudnn, chunked
CHUNK = 128  # query rows per block of the chunked backend (bench/attention.py)
HIGHEST = jax.lax.Precision.HIGHEST  # the reference is the definition: no TF32 on GPUs

# ---- attention math ---------------------------------------------------------------


def _as_4d(x):
    """Left-pad a mask or bias with size-1 axes to [B|1, N|1, Tq, Tk]."""
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def _group(x, n_kv_heads: int):
    """[B, N|1, T, S] -> [B, K|1, G|1, T, S], grouping query heads by their K/V head."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], n_kv_heads, x.shape[1] // n_kv_heads, *x.shape[2:])


def _groups(n_heads: int, n_kv_heads: int) -> int:
    """Query heads per key/value head (GQA)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads "
                         f"({n_kv_heads})")
    return n_heads // n_kv_heads


def _grouped_logits(q, k, *, mask, bias, scale, precision=HIGHEST):
    """Float32 logits [B, K, G, Tq, Tk], masked entries -inf. GQA groups the query heads,
    so K/V are never copied per query head."""
    b, t, n, h = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, _groups(n, n_kv), h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=precision,
                        preferred_element_type=jnp.float32)
    return _scale_and_mask(logits, mask=mask, bias=bias,
                           scale=1.0 / math.sqrt(h) if scale is None else scale)


def _scale_and_mask(logits, *, mask, bias, scale):
    """logits [B, K, G, Tq, Tk] * scale (+ bias), masked entries -inf."""
    n_kv = logits.shape[1]
    logits = logits * jnp.float32(scale)
    if bias is not None:
        logits = logits + _group(bias.astype(jnp.float32), n_kv)
    if mask is not None:
        logits = jnp.where(_group(mask, n_kv), logits, -jnp.inf)
    return logits


def _exp_rows(logits):
    """exp(logits - row max) in float32 (0 where -inf; the max of a row with nothing to
    attend to taken as 0) and the row sums [..., 1]."""
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    e = jnp.exp(logits - peak)
    return e, jnp.sum(e, axis=-1, keepdims=True)


def _softmax(logits):
    """Softmax over the last axis in float32; a row with nothing to attend to gives zeros."""
    e, total = _exp_rows(logits)
    return e / jnp.where(total == 0, 1.0, total)


def _mix(w, v, q, precision=HIGHEST):
    """Weights w [B, K, G, Tq, Tk] applied to v [B, Tk, K, H] -> [B, Tq, N, H] in q.dtype."""
    out = jnp.einsum("bkgts,bskh->btkgh", w.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def _and_causal(mask, t: int):
    """A 4-D mask (or None) and the index-causal mask of t queries over t keys."""
    causal = causal_index_mask(t)
    return causal if mask is None else mask & causal


def attention_weights(q, k, *, mask=None, bias=None, scale=None):
    """Softmax attention weights [B, N, Tq, Tk] in float32 (for inspection and plots)."""
    w = _softmax(_grouped_logits(q, k, mask=_as_4d(mask), bias=_as_4d(bias), scale=scale))
    return w.reshape(w.shape[0], -1, *w.shape[3:])  # [B, K, G, T, S] -> [B, N, T, S]


def _reference(q, k, v, *, mask, bias, scale, precision=HIGHEST):
    w = _softmax(_grouped_logits(q, k, mask=mask, bias=bias, scale=scale,
                                 precision=precision))  # [B, K, G, T, S]
    return _mix(w, v, q, precision)  # [B, T, N, H]


def _fused(q, k, v, *, mask, bias, scale, implementation, **structure):
    """jax.nn.dot_product_attention (XLA, or cuDNN flash attention on GPU); structure:
    its is_causal and local_window_size, which cuDNN reads without a mask array.

    Its masked rows average over all keys; rows with no allowed key are set to zero here so
    that every backend answers like the reference.
    """
    if bias is not None and implementation == "cudnn":
        bias = bias.astype(q.dtype)  # cuDNN takes the bias in the dtype of q
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                       implementation=implementation, **structure)
    if mask is not None:
        any_key = jnp.any(mask, axis=-1)  # [B, 1|N, T]
        out = out * jnp.swapaxes(any_key, 1, 2)[..., None].astype(out.dtype)
    return out


def _blockwise_dense(q, k, v, *, mask, bias, scale, is_causal):
    """Blockwise attention for masks and biases given as arrays: their positions are
    indices, and the mask joins the bias as -inf (the model passes structure instead)."""
    b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    index = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))  # noqa: E731
    terms = None if bias is None else bias.astype(jnp.float32)
    if mask is not None:
        hide = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
        terms = hide if terms is None else terms + hide
    rule = MaskRule(index(tq), index(tk), causal=False, is_causal=is_causal)
    return blockwise_attention(q, k, v, rule, bias_fn=None if terms is None else index_bias,
                               bias_params=terms, scale=scale)


STRUCTURED = ("blockwise", "splash")  # backends that read the MaskRule a block at a time


def takes_structure(impl: str, t: int, cached: bool) -> bool:
    """Whether attention over t queries runs a backend that reads the MaskRule and the
    bias as a LogitBias a block at a time: blockwise or splash; with a KV cache only a
    prefill does (T > 1, blockwise over the cache): a decode step's [B, N, 1, S] is
    small, and cached_attention is faster for it."""
    return impl in STRUCTURED and (not cached or t > 1)


def rule_attention(q, k, v, rule: MaskRule, bias=None, *, impl: str = "auto"):
    """Attention of q [B, T, N, H] over k, v [B, S, K, H] with the mask given as a rule:
    the model's path (self-attention; blockwise also over a KV cache's slots). blockwise
    and splash read the rule and the LogitBias a block at a time; xla and cudnn get
    is_causal and local_window_size with no mask array when the rule is by index and
    nothing is packed or padded; otherwise, and for reference and chunked, the rule's mask
    array. bias: a LogitBias, an array [B|1, N|1, T, S], or None."""
    impl = resolve_impl(impl, q.dtype, q.shape[-1],
                        logits_bytes=4 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1])
    if impl in STRUCTURED:
        if bias is not None and not isinstance(bias, LogitBias):
            raise ValueError(f"attention_impl={impl!r} takes the bias as a LogitBias "
                             "(jaxformer.attention.PositionBias), not an array")
        if impl == "splash":
            if bias is not None:
                raise ValueError("attention_impl='splash' adds no logit bias; use 'blockwise'")
            return splash_attention(q, k, v, rule)
        return blockwise_attention(q, k, v, rule, bias_fn=None if bias is None else bias.fn,
                                   bias_params=None if bias is None else bias.params)
    if isinstance(bias, LogitBias):
        bias = dense_bias(bias, rule.q_positions, rule.k_positions)
    causal = rule.causal or rule.is_causal
    if impl in ("xla", "cudnn") and rule.by_index and causal and rule.q_segment_ids is None:
        window = None if rule.window is None else (rule.window - 1, 0)
        return _fused(q, k, v, mask=None, bias=_as_4d(bias), scale=None, implementation=impl,
                      is_causal=True, local_window_size=window)
    return dot_product_attention(q, k, v, mask=rule.dense(), bias=bias, impl=impl,
                                 is_causal=rule.is_causal)


def cached_attention(q, k, v, *, mask=None, bias=None):
    """Attention of q [B, T, N, H] over a KV cache k, v [B * K, S, H]: one row of slots per
    (batch row, K/V head), batch-major.

    One row axis, not [B, K, S, H]: at batch 1 XLA drops the size-1 batch axis from the
    matmuls, and the reshape that then sits between the in-place cache update and the matmul
    made XLA:CPU copy each layer's K four times and transpose V on every decode step
    (bench/decode.py, batch 1: ~0.45 -> ~0.2 ms per token). B * K == 1 (MQA at batch 1)
    still collapses, and still copies. [B, S, K, H] transposes the cache at every batch."""
    b, t, n, h = q.shape
    rows, s, _ = k.shape
    n_kv = rows // b
    g = n // n_kv
    q = q.reshape(b, t, n_kv, g, h).transpose(0, 2, 3, 1, 4).reshape(rows, g * t, h)
    logits = jnp.einsum("rqh,rsh->rqs", q, k, preferred_element_type=jnp.float32)
    logits = _scale_and_mask(logits.reshape(b, n_kv, g, t, s), mask=mask, bias=bias,
                             scale=1.0 / math.sqrt(h))
    w = _softmax(logits).reshape(rows, g * t, s)
    out = jnp.einsum("rqs,rsh->rqh", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, n_kv, g, t, h).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def causal_index_mask(t: int):
    """Query i attends to keys 0..i, by index in the row (is_causal). -> [1, 1, T, T]"""
    return jnp.tril(jnp.ones((t, t), bool))[None, None]


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


def _chunked(q, k, v, *, mask, bias, scale, is_causal):
    """Heads-first attention in blocks of CHUNK query rows; with is_causal a block reads
    only the keys up to its last row, skipping the masked upper triangle's work.

    Each block's softmax runs over every key the block can see, so no online rescaling is
    needed and the result is the reference's. On XLA:CPU the [B, K, G, T, H] layout runs
    its batched matmuls ~2x faster than [B, T, N, H]. The backward pass is written out
    (_heads_first_bwd) rather than differentiated through the masked softmax."""
    b, t, n, h = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    qh = q.reshape(b, t, n_kv, _groups(n, n_kv), h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    out = _heads_first(scale, is_causal, qh, kh, vh, mask, bias)  # [B, K, G, T, H] float32
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _heads_first(scale, is_causal, q, k, v, mask, bias):
    """q [B, K, G, T, H], k/v [B, K, S, H] -> float32 [B, K, G, T, H], block by block."""
    return _heads_first_fwd(scale, is_causal, q, k, v, mask, bias)[0]


def _block_exp(scale, is_causal, q, k, mask, bias, start, stop, keys):
    """A block's unnormalised weights e = exp(logits - row max) [B, K, G, rows, keys] (0
    where masked) and 1 / their row sums [B, K, G, rows, 1] (0 for a row with no key)."""
    logits = jnp.einsum("bkgth,bksh->bkgts", q[:, :, :, start:stop], k[:, :, :keys],
                        preferred_element_type=jnp.float32)
    block_mask = _rows(mask, start, stop, keys)
    if is_causal:
        diagonal = causal_index_mask(keys)[:, :, start:stop]
        block_mask = diagonal if block_mask is None else block_mask & diagonal
    logits = _scale_and_mask(logits, mask=block_mask, bias=_rows(bias, start, stop, keys),
                             scale=scale)
    e, total = _exp_rows(logits)
    return e, jnp.where(total == 0, 0.0, 1.0 / jnp.where(total == 0, 1.0, total))


def _heads_first_fwd(scale, is_causal, q, k, v, mask, bias):
    """Softmax(logits) V as (e V) / rowsum(e): the division touches [rows, H], not the
    [rows, keys] weights, which are never formed."""
    outs, saved = [], []
    for start, stop, keys in _blocks(q.shape[3], k.shape[2], is_causal):
        e, inv = _block_exp(scale, is_causal, q, k, mask, bias, start, stop, keys)
        saved.append((e, inv))
        outs.append(jnp.einsum("bkgts,bksh->bkgth", e.astype(v.dtype), v[:, :, :keys],
                               preferred_element_type=jnp.float32) * inv)
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, T, H]
    return out, (q, k, v, mask, bias, saved, out)


def _heads_first_bwd(scale, is_causal, res, d_out):
    """With P = e / rowsum(e) a block's weights: dV = P^T dO, dP = dO V^T, and the
    logits' gradient dS = P (dP - rowsum(dO * O)) (the softmax's Jacobian, summed over H
    instead of over the keys); dQ = scale dS K, dK = scale dS^T Q, and the bias gets dS.
    P is folded in as e and 1 / rowsum(e): dV = e^T (dO / rowsum(e))."""
    q, k, v, mask, bias, saved, out = res
    f32 = jnp.float32
    delta = jnp.sum(d_out * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    dbias = None if bias is None else jnp.zeros(bias.shape, f32)
    blocks = _blocks(q.shape[3], k.shape[2], is_causal)
    for (start, stop, keys), (e, inv) in zip(blocks, saved):
        do = d_out[:, :, :, start:stop]  # [B, K, G, rows, H]
        dv = dv.at[:, :, :keys].add(jnp.einsum("bkgts,bkgth->bksh", e.astype(v.dtype),
                                               (do * inv).astype(v.dtype),
                                               preferred_element_type=f32))
        dw = jnp.einsum("bkgth,bksh->bkgts", do.astype(v.dtype), v[:, :, :keys],
                        preferred_element_type=f32)
        ds = e * inv * (dw - delta[:, :, :, start:stop])  # [B, K, G, rows, keys]
        if bias is not None:
            dbias = _add_rows(dbias, ds, start, stop, keys)
        ds = (ds * f32(scale)).astype(q.dtype)
        dq.append(jnp.einsum("bkgts,bksh->bkgth", ds, k[:, :, :keys], preferred_element_type=f32))
        dk = dk.at[:, :, :keys].add(jnp.einsum("bkgts,bkgth->bksh", ds, q[:, :, :, start:stop],
                                               preferred_element_type=f32))
    dq = jnp.concatenate(dq, axis=3).astype(q.dtype)
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None,
            None if bias is None else dbias.astype(bias.dtype))


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


DENSE_LOGITS_BYTES = 1 << 30  # auto: above this, float32 [B, N, Tq, Tk] logits go blockwise
_EXPLAINED: set = set()


def resolve_impl(impl: str, dtype, head_dim: int, logits_bytes: int = 0,
                 position: str | None = None) -> str:
    """`auto` by platform, position scheme and length; logits_bytes: the dense float32
    logits of one layer, B * N * Tq * Tk * 4.

    - TPU: splash, or blockwise for a scheme with a logit bias (ALiBi, T5, FIRE), which
      the splash kernel does not take;
    - GPU: cuDNN flash attention for 16-bit inputs with head_dim a multiple of 8 up to 128
      (a bias scheme only while its dense bias fits DENSE_LOGITS_BYTES);
    - otherwise, while the logits fit DENSE_LOGITS_BYTES: chunked on a CPU
      (bench/attention.py: fastest there, forward and backward), XLA's
      jax.nn.dot_product_attention elsewhere; beyond it, blockwise (memory linear in T).

    The choice and its reason are printed once per process."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} is not one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    backend, biased = jax.default_backend(), position in POSITION_BIASES
    if backend == "tpu":
        return _explain("blockwise", f"a TPU, and position={position!r} adds a logit bias, "
                        "which the splash kernel does not take") if biased else \
            _explain("splash", "a TPU, and no logit bias")
    big = logits_bytes > DENSE_LOGITS_BYTES
    budget = (f"dense logits would take {logits_bytes / 2**30:.1f} GiB per layer "
              f"(> DENSE_LOGITS_BYTES = {DENSE_LOGITS_BYTES / 2**30:g} GiB)")
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and \
            head_dim % 8 == 0 and head_dim <= 128 and not (biased and big):
        return _explain("cudnn", "a GPU, 16-bit inputs, head_dim a multiple of 8 up to 128")
    if big:
        return _explain("blockwise", budget + (f" and position={position!r}'s bias with them"
                                               if backend == "gpu" and biased else ""))
    return "chunked" if backend == "cpu" else "xla"


def _explain(choice: str, reason: str) -> str:
    if (choice, reason) not in _EXPLAINED:
        _EXPLAINED.add((choice, reason))
        print(f"attention: auto chose {choice}: {reason}", file=sys.stderr, flush=True)
    return choice


def dot_product_attention(q, k, v, *, mask=None, bias=None, impl: str = "auto", scale=None,
                          is_causal: bool = False):
    """softmax(q k^T / sqrt(head_dim) + bias, where mask) v.

    q: [B, Tq, N, H]; k, v: [B, Tk, K, H] with N a multiple of K (GQA; K = 1 is MQA).
    mask: bool, broadcastable to [B, N, Tq, Tk] with a size-1 or full head axis.
    bias: float, same broadcasting. is_causal: also hide every key after the query's own
    index (self-attention, Tq = Tk), which lets the chunked backend skip that work.
    Softmax runs in float32 whatever the input dtype; a query with no key to attend to
    gets a zero output. Returns [B, Tq, N, H] in q.dtype.
    impl: reference (einsum, the definition), xla / cudnn (jax.nn.dot_product_attention),
    chunked (heads-first blocks, see _chunked), blockwise (online softmax over key
    blocks, memory linear in T: jaxformer.blockwise; the model hands it structure, not
    arrays), or auto.
    """
    impl = resolve_impl(impl, q.dtype, q.shape[-1])
    mask, bias = _as_4d(mask), _as_4d(bias)
    if is_causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"is_causal needs as many keys as queries, got {q.shape[1]} queries "
                         f"and {k.shape[1]} keys")
    if impl == "chunked":
        return _chunked(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal)
    if impl == "splash":
        raise ValueError("splash takes the mask as structure, not arrays: set the model's "
                         "attention_impl='splash', or call jaxformer.splash.splash_attention "
                         "with a MaskRule")
    if impl == "blockwise":
        return _blockwise_dense(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal)
    if is_causal:
        mask = _and_causal(mask, q.shape[1])
    if impl == "reference":
        return _reference(q, k, v, mask=mask, bias=bias, scale=scale)
    return _fused(q, k, v, mask=mask, bias=bias, scale=scale, implementation=impl)


# ---- the module -------------------------------------------------------------------


def dense_init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


class Attention(nn.Module):
    """Multi-head (GQA/MQA) self-attention with RoPE or ALiBi when the config asks.

    Params: query [D, N, H], key/value [D, K, H], out [N, H, D]; biases on q/k/v if
    qkv_bias, on out if use_bias.
    """

    cfg: ModelConfig
    deterministic: bool = True

    def setup(self):
        c = self.cfg
        def dense(feats, axis, name, names, bias, std=0.02):  # names: the kernel's logical axes
            return nn.DenseGeneral(
                feats, axis=axis, use_bias=bias, dtype=c.dtype, param_dtype=c.param_dtype,
                kernel_init=init_with_names(dense_init(std), *names),
                bias_init=init_with_names(nn.initializers.zeros, *names[len(axis):]),
                dot_general=flat_dot_general, name=name)

        q_names, kv_names = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.query = dense((c.n_heads, c.head_dim), (-1,), "query", q_names, c.qkv_bias)
        self.key = dense((c.n_kv_heads, c.head_dim), (-1,), "key", kv_names, c.qkv_bias)
        self.value = dense((c.n_kv_heads, c.head_dim), (-1,), "value", kv_names, c.qkv_bias)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers)
        self.out = dense(c.d_model, (-2, -1), "out", ("heads", "head_dim", "embed"), c.use_bias,
                         0.02 / math.sqrt(2 * c.n_layers))
        self.dropout = nn.Dropout(c.dropout)

    def project(self, x, positions):
        """x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H]; RoPE applied to q and k."""
        q, k, v = (hook_point(self, f"hook_{n}", f(x))
                   for n, f in (("q", self.query), ("k", self.key), ("v", self.value)))
        if self.cfg.position == "rope":
            theta, scaling = self.cfg.rope_theta, self.cfg.rope_scaling
            q = hook_point(self, "hook_rot_q", apply_rope(q, positions, theta=theta,
                                                          scaling=scaling))
            k = hook_point(self, "hook_rot_k", apply_rope(k, positions, theta=theta,
                                                          scaling=scaling))
        q = constrain(q, "act_batch", "act_seq", "act_heads", "head_dim")
        k = constrain(k, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        v = constrain(v, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        return q, k, v

    def attend_with_pattern(self, q, k, v, mask, bias):
        """The reference attention with hook points on the scores (scaled, biased, -inf where
        masked) and the pattern [B, N, Tq, Tk]: for jaxformer.inspect, when asked for."""
        logits = _grouped_logits(q, k, mask=_and_causal(_as_4d(mask), q.shape[1]),
                                 bias=_as_4d(bias), scale=None)  # [B, K, G, T, S]
        scores = hook_point(self, "hook_attn_scores",
                            logits.reshape(q.shape[0], -1, *logits.shape[3:]))  # [B, N, T, S]
        pattern = hook_point(self, "hook_pattern", _softmax(scores))
        return _mix(_group(pattern, k.shape[2]), v, q)  # [B, T, N, H]

    def finish(self, z):
        """Heads [B, T, N, H] -> output projection (+ dropout) [B, T, D]."""
        return self.dropout(self.out(z), deterministic=self.deterministic)

    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None):
        """Without a cache: attention within x. With a layer cache {"k", "v": [B*K, S, H]}:
        the new keys/values are written at slots [cache_index, cache_index + T) (the caller
        keeps that within S: dynamic_update_slice clamps, it does not grow), attention runs
        over all S slots (the mask hides slots not written or not valid), and the updated
        layer cache is returned beside the output.

        mask: a MaskRule (the model's) or a bool array; bias: a LogitBias where
        takes_structure says, else an array or None."""
        q, k, v = self.project(x, positions)
        if cache is None:
            return self.finish(hook_point(self, "hook_z", self.attend(q, k, v, mask, bias)))
        b, t, n_kv, h = k.shape  # the cache is [B * K, S, H]: see cached_attention

        def update(cache, new):  # sharded as [B, K, S, H]: rows over batch, then heads
            cache = jax.lax.dynamic_update_slice(
                cache, jnp.swapaxes(new, 1, 2).reshape(b * n_kv, t, h).astype(cache.dtype),
                (0, cache_index, 0))
            return constrain(cache.reshape(b, n_kv, -1, h), "act_batch", "act_kv_heads",
                             "act_seq", "head_dim").reshape(cache.shape)

        cache = {name: update(cache[name], new) for name, new in (("k", k), ("v", v))}
        k, v = (cache[name].astype(q.dtype) for name in ("k", "v"))
        if takes_structure(self.cfg.attention_impl, t, cached=True):  # a prefill, by blocks
            k, v = (x.reshape(b, n_kv, -1, h).swapaxes(1, 2) for x in (k, v))  # [B, S, K, H]
            z = rule_attention(q, k, v, mask, bias, impl="blockwise")
        else:
            z = cached_attention(q, k, v, bias=bias,
                                 mask=mask.dense() if isinstance(mask, MaskRule) else mask)
        return self.finish(hook_point(self, "hook_z", z)), cache

    def attend(self, q, k, v, mask, bias):
        """Attention within the sequence: the hooked reference when inspection asks for
        scores or patterns (the whole grid, for this layer), else the configured backend."""
        if active(self, "hook_attn_scores", "hook_pattern"):
            if isinstance(mask, MaskRule):
                if isinstance(bias, LogitBias):
                    bias = dense_bias(bias, mask.q_positions, mask.k_positions)
                mask = mask.dense()
            return self.attend_with_pattern(q, k, v, mask, bias)
        if isinstance(mask, MaskRule):
            return rule_attention(q, k, v, mask, bias, impl=self.cfg.attention_impl)
        return dot_product_attention(q, k, v, mask=mask, bias=bias,
                                     impl=self.cfg.attention_impl, is_causal=True)


def _alibi(module, cfg: ModelConfig):
    return alibi_bias, jnp.asarray(alibi_slopes(cfg.n_heads), jnp.float32)


@dataclasses.dataclass(frozen=True)
class _T5Bias:  # hashable by value: blockwise attention takes it as a static argument
    max_distance: int

    def __call__(self, table, q_positions, k_positions):
        return t5_bias(table, q_positions, k_positions, max_distance=self.max_distance)


def _t5(module, cfg: ModelConfig):
    table = module.param("relative_bias", init_with_names(dense_init(), "table", "heads"),
                         (cfg.t5_num_buckets, cfg.n_heads), cfg.param_dtype)
    return _T5Bias(cfg.t5_max_distance), table


def _fire(module, cfg: ModelConfig):
    """FIRE's bias, with the reference code's settings: an MLP 1 -> 32 -> heads (ReLU),
    c initialised at 0.1, the threshold at FIRE_THRESHOLD (learned as a multiple of it)."""
    param = lambda name, init, shape, *names, dtype=cfg.param_dtype: module.param(  # noqa: E731
        name, init_with_names(init, *names), shape, dtype)
    return fire_bias, {
        "c": param("c", nn.initializers.constant(0.1), (), dtype=jnp.float32),
        "threshold_scale": param("threshold_scale", nn.initializers.ones, (), dtype=jnp.float32),
        "hidden_kernel": param("hidden_kernel", nn.initializers.normal(1.0), (FIRE_WIDTH,),
                               "pos_mlp"),
        "hidden_bias": param("hidden_bias", nn.initializers.zeros, (FIRE_WIDTH,), "pos_mlp"),
        "out_kernel": param("out_kernel", nn.initializers.lecun_normal(),
                            (FIRE_WIDTH, cfg.n_heads), "pos_mlp", "heads"),
        "out_bias": param("out_bias", nn.initializers.zeros, (cfg.n_heads,), "heads")}


def fire_bias(p, q_positions, k_positions):
    """FIRE's logit bias from its params `p`: [B, N, Tq, Tk] float32."""
    f32 = lambda name: p[name].astype(jnp.float32)  # noqa: E731
    x = fire_distance(q_positions, k_positions, p["c"],
                      jnp.abs(p["threshold_scale"] * FIRE_THRESHOLD))[..., None]
    h = nn.relu(x * f32("hidden_kernel") + f32("hidden_bias"))  # [B, T, S, W]
    return jnp.einsum("btsw,wn->bnts", h, f32("out_kernel")) + f32("out_bias")[:, None, None]


FIRE_WIDTH = 32  # FIRE's hidden layer
# position scheme -> (bias_fn, params) from (module, cfg): bias_fn(params, q positions
# [B, Tq], k positions [B, Tk]) -> the logit bias [B|1, N, Tq, Tk]
POSITION_BIASES = {"alibi": _alibi, "t5": _t5, "fire": _fire}


@flax.struct.dataclass
class LogitBias:
    """A position scheme's logit bias as structure: fn(params, q_positions [B, Tq],
    k_positions [B, Tk]) -> float32 [B|1, N, Tq, Tk], and its params. A pytree: jit, scan,
    remat and vmap carry the params, and fn (hashable) travels in the treedef."""

    fn: Callable = flax.struct.field(pytree_node=False)
    params: Any = None


def dense_bias(bias: LogitBias | None, q_positions, k_positions):
    """The bias applied to every (query, key) pair: [B|1, N, Tq, Tk], or None."""
    return None if bias is None else bias.fn(bias.params, q_positions, k_positions)


class PositionBias(nn.Module):
    """The attention-logit bias of the position scheme as a LogitBias, shared by
    every layer (as T5 does), or None for a scheme without one. Dense backends apply
    bias_fn to all positions once per forward pass; blockwise attention to each block.

    Keys may be cache slots: an empty slot's far-future position gives a finite bias that
    the mask then hides."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self):
        make = POSITION_BIASES.get(self.cfg.position)
        return None if make is None else LogitBias(*make(self, self.cfg))
