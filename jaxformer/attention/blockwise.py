"""Blockwise (flash) attention in pure JAX: memory linear in the sequence length, forward
and backward, for every mask rule and every position bias.

For each block of query rows, keys are visited a block at a time with an online softmax
(Milakov & Gimelshein 2018; Dao et al. 2022): a running row max m, row sum l and
unnormalised output are rescaled as each key block arrives, so no [Tq, Tk] array is
formed. The backward pass (custom_vjp) recomputes each block's logits from q, k and the
saved row log-sum-exp, and accumulates dq, dk, dv and the bias parameters' gradient.

The mask is a rule (jaxformer.attention.masks.MaskRule) applied to each block; a bias is a
function ``bias_fn(params, q_positions, k_positions) -> [B|1, N, bq, bk]`` applied to
each block, with `params` (ALiBi's slopes, T5's bucket table, FIRE's MLP) getting their
gradient. A softcap caps the scaled logits s as softcap * tanh(s / softcap) before the
bias and the mask (Gemma 2); the backward multiplies the logits' gradient by the cap's
slope 1 - tanh(s / softcap)^2 for q and k (the bias's gradient is taken before it). Key
blocks past a query block's last row are never visited under is_causal;
blocks the rule masks entirely (outside a window, another packed segment, padding) are
skipped at run time by lax.cond on the blocks' position and segment ranges. Attention
sinks (a logit per query head, jaxformer.core.reference) start each row's online softmax: the
running max at the sink and the running sum at 1, so the saved log-sum-exp includes them.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.attention.masks import MaskRule
from jaxformer.core.reference import check_softcap, group_sinks

# Query rows and keys per block. Forward+backward of causal attention, B 1, 8 heads of 32,
# 2-core Zen 4: T 2048: 125 ms in blocks of 256, 147 ms in blocks of 512 (XLA's dense
# 568 ms); T 4096: 464 and 550 ms (dense 2,808 ms).
BLOCK_Q = 256
BLOCK_K = 256


class _Static(NamedTuple):  # the mask's own settings travel in MaskRule's treedef
    bias_fn: Callable | None
    scale: float
    bq: int
    bk: int
    n_keys: int  # keys before padding
    softcap: float | None = None  # logits capped as softcap * tanh(s / softcap); None: not


def blockwise_attention(q, k, v, rule: MaskRule, *, bias_fn=None, bias_params=None,
                        scale=None, block_q: int | None = None, block_k: int | None = None,
                        softcap: float | None = None, sinks=None):
    """softmax(cap(q k^T * scale) + bias, where rule allows) v, a block at a time, with
    cap(s) = softcap * tanh(s / softcap) when softcap is given, else s; sinks [N]: a logit
    per query head in every row's softmax (None: none).

    q: [B, T, N, H]; k, v: [B, S, K, H] (N a multiple of K; GQA without copying K/V).
    rule: positions and segment ids of queries and keys, causal, window, is_causal.
    bias_fn: hashable, (bias_params, q_positions [B, bq], k_positions [B, bk]) -> float
    [B|1, N, bq, bk]. Any T and S: blocks are padded inside. A query with no key it may
    attend to gets zeros. Returns [B, T, N, H] in q.dtype."""
    st, qh, kh, vh, rule = prepare(q, k, v, rule, bias_fn=bias_fn, scale=scale,
                                   block_q=block_q, block_k=block_k, softcap=softcap)
    out = _flash(st, qh, kh, vh, rule, bias_params, group_sinks(sinks, k.shape[2]))
    return heads_back(out, q)  # from [B, K, G, Tp, H] float32


def heads_back(out, q):
    """[B, K, G, Tp, H] float32 -> q's layout, length and dtype [B, T, N, H]."""
    b, t, n, _ = q.shape  # out's head_dim is the values'
    return out.transpose(0, 3, 1, 2, 4).reshape(b, -1, n, out.shape[-1])[:, :t].astype(q.dtype)


def prepare(q, k, v, rule: MaskRule, *, bias_fn=None, scale=None, block_q=None, block_k=None,
            softcap=None):
    """The static settings and the inputs as the block loops read them: q [B, K, G, Tp,
    H], k, v [B, K, Sp, H] and the rule, padded to whole blocks (padded keys hidden by
    the key count, padded queries cut by heads_back)."""
    b, t, n, h = q.shape
    s, n_kv = k.shape[1], k.shape[2]
    if n % n_kv:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({n_kv})")
    bq, bk = min(block_q or BLOCK_Q, t), min(block_k or BLOCK_K, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    pad = lambda x, to: jnp.pad(x, [(0, 0), (0, to - x.shape[1])] +  # noqa: E731
                                [(0, 0)] * (x.ndim - 2), mode="edge" if x.ndim == 2 else "constant")
    q_seg, k_seg = (None if x is None else pad(x, to) for x, to in
                    ((rule.q_segment_ids, tp), (rule.k_segment_ids, sp)))
    rule = rule.replace(q_positions=pad(rule.q_positions, tp), q_segment_ids=q_seg,
                        k_positions=pad(rule.k_positions, sp), k_segment_ids=k_seg)
    st = _Static(bias_fn, 1.0 / math.sqrt(h) if scale is None else float(scale), bq, bk, s,
                 check_softcap(softcap))
    qh = pad(q, tp).reshape(b, tp, n_kv, n // n_kv, h).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,H]
    kh, vh = (pad(x, sp).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, S, H]
    return st, qh, kh, vh, rule


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, rule: MaskRule, params, sinks):
    return _forward(st, q, k, v, rule, params, sinks)[0]


def _flash_fwd(st: _Static, q, k, v, rule: MaskRule, params, sinks):
    out, res = _forward(st, q, k, v, rule, params, sinks)
    return out, (res, sinks)


def _flash_bwd(st: _Static, saved, d_out):
    res, sinks = saved
    return _backward(st, res, d_out) + (sink_grad(sinks, res[-2], res[-1], d_out),)


def sink_grad(sinks, out, lse, d_out):
    """The sinks' gradient [K, G, 1, 1]: a sink is a key with a zero value, so its logit
    gets -P_sink rowsum(dO * O), summed over the rows (P_sink = exp(sink - lse), the
    log-sum-exp including the sink); None without sinks."""
    if sinks is None:
        return None
    delta = jnp.sum(d_out * out, axis=-1)  # [B, K, G, T]
    p_sink = jnp.exp(sinks[..., 0] - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(sinks.shape)


def _key_blocks(st: _Static, rule: MaskRule, i, n_k: int):
    """How many key blocks query block i visits: those up to its last row under is_causal."""
    return jnp.minimum(((i + 1) * st.bq + st.bk - 1) // st.bk, n_k) if rule.is_causal else n_k


def _block_positions(st: _Static, rule: MaskRule, i, j):
    """The positions [B, bq] of query block i and [B, bk] of key block j."""
    return (jax.lax.dynamic_slice_in_dim(rule.q_positions, i * st.bq, st.bq, axis=1),
            jax.lax.dynamic_slice_in_dim(rule.k_positions, j * st.bk, st.bk, axis=1))


def _may_attend(st: _Static, rule: MaskRule, i, j):
    """False only if rule masks every pair of query block i and key block j: from the
    blocks' position and segment ranges, per row, any row."""
    qp, kp = _block_positions(st, rule, i, j)
    ok = (j * st.bk < st.n_keys) & jnp.ones(qp.shape[0], bool)
    if rule.causal:
        ok &= kp.min(1) <= qp.max(1)
    if rule.any_window is not None:  # static, or traced (layer kinds in a scan)
        ok &= qp.min(1) - kp.max(1) < rule.any_window
        if not rule.causal:  # a symmetric window: keys ahead of the queries too
            ok &= kp.min(1) - qp.max(1) < rule.any_window
    if rule.q_segment_ids is not None:
        qs = jax.lax.dynamic_slice_in_dim(rule.q_segment_ids, i * st.bq, st.bq, axis=1)
        ks = jax.lax.dynamic_slice_in_dim(rule.k_segment_ids, j * st.bk, st.bk, axis=1)
        ok &= (qs.max(1) >= ks.min(1)) & (qs.min(1) <= ks.max(1)) & (ks.max(1) > 0)
    return ok.any()


def _block_scores(st: _Static, q_i, k_j):
    """Query block i's scaled logits against key block j, soft-capped if st.softcap:
    float32 [B, K, G, bq, bk], and tanh(s / softcap) (None without a cap)."""
    scores = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j,
                        preferred_element_type=jnp.float32) * jnp.float32(st.scale)
    if st.softcap is None:
        return scores, None
    cap = jnp.float32(st.softcap)
    tanh = jnp.tanh(scores / cap)
    return cap * tanh, tanh


def _block_logits(st: _Static, scores, rule: MaskRule, params, i, j):
    """Block (i, j)'s scores (_block_scores) plus the bias, -inf where masked:
    float32 [B, K, G, bq, bk]."""
    logits = scores
    if st.bias_fn is not None:
        logits = logits + _block_bias(st, params, rule, i, j, logits.shape)
    mask = rule.block(i * st.bq, st.bq, j * st.bk, st.bk)  # [B, 1, bq, bk]
    mask &= (j * st.bk + jnp.arange(st.bk) < st.n_keys)[None, None, None]
    return jnp.where(mask[:, :, None], logits, -jnp.inf)


def _block_bias(st: _Static, params, rule: MaskRule, i, j, shape):
    bias = st.bias_fn(params, *_block_positions(st, rule, i, j)).astype(jnp.float32)  # [B|1, N, bq, bk]
    b, n_kv, g, rows, keys = shape
    return jnp.broadcast_to(bias, (b, n_kv * g, rows, keys)).reshape(shape)


def _forward(st: _Static, q, k, v, rule: MaskRule, params, sinks=None):
    n_q, n_k = q.shape[3] // st.bq, k.shape[2] // st.bk

    def query_block(i):
        q_i = jax.lax.dynamic_slice_in_dim(q, i * st.bq, st.bq, axis=3)
        row = q_i.shape[:4]
        m, l = (jnp.full(row, -jnp.inf), jnp.zeros(row)) if sinks is None else \
            (jnp.broadcast_to(sinks[..., 0], row), jnp.ones(row))  # the sink seen first
        init = (m, l, jnp.zeros(row + v.shape[-1:], jnp.float32))

        def visit(j, carry):
            m, l, acc = carry
            k_j = jax.lax.dynamic_slice_in_dim(k, j * st.bk, st.bk, axis=2)
            logits = _block_logits(st, _block_scores(st, q_i, k_j)[0], rule, params, i, j)
            m_new = jnp.maximum(m, logits.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(logits - safe[..., None])
            rescale = jnp.exp(m - safe)
            v_j = jax.lax.dynamic_slice_in_dim(v, j * st.bk, st.bk, axis=2)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, l * rescale + p.sum(-1), acc * rescale[..., None] + pv

        def step(j, carry):
            return jax.lax.cond(_may_attend(st, rule, i, j), visit, lambda j, c: c, j, carry)

        m, l, acc = jax.lax.fori_loop(0, _key_blocks(st, rule, i, n_k), step, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return out, jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)

    outs, lse = jax.lax.map(query_block, jnp.arange(n_q))  # [n_q, B, K, G, bq(, H)]
    out = jnp.moveaxis(outs, 0, 3).reshape(q.shape[:3] + (-1, v.shape[-1]))
    lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:3] + (-1,))
    return out, (q, k, v, rule, params, out, lse)


def _zeros(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _block_grads(st: _Static, q_i, do_i, lse_i, delta_i, k, v, rule, params, i, j):
    """Query block i's and key block j's share of the gradients: (dq_i, dk_j, dv_j, the
    bias params'), from the logits recomputed and the saved row log-sum-exp."""
    f32 = jnp.float32
    v_j = jax.lax.dynamic_slice_in_dim(v, j * st.bk, st.bk, axis=2)
    k_j = jax.lax.dynamic_slice_in_dim(k, j * st.bk, st.bk, axis=2)
    scores, tanh = _block_scores(st, q_i, k_j)
    if st.bias_fn is None:
        logits = _block_logits(st, scores, rule, params, i, j)
    else:
        logits, pull = jax.vjp(lambda p: _block_logits(st, scores, rule, p, i, j), params)
    p = jnp.exp(logits - lse_i[..., None])  # 0 where masked or the row has no key
    dv_j = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(v.dtype), do_i.astype(v.dtype),
                      preferred_element_type=f32)
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i.astype(v.dtype), v_j, preferred_element_type=f32)
    ds = p * (dp - delta_i[..., None])  # d logits (after scale, cap and bias)
    d_bias = _zeros(params) if st.bias_fn is None else \
        jax.tree.map(lambda b: b.astype(f32), pull(ds)[0])
    if tanh is not None:  # d(cap tanh(s / cap)) / ds
        ds = ds * (1.0 - tanh * tanh)
    ds_q = (ds * f32(st.scale)).astype(q_i.dtype)
    dq_j = jnp.einsum("bkgqs,bksh->bkgqh", ds_q, k_j, preferred_element_type=f32)
    dk_j = jnp.einsum("bkgqs,bkgqh->bksh", ds_q, q_i, preferred_element_type=f32)
    return dq_j, dk_j, dv_j, d_bias


def _backward(st: _Static, res, d_out):
    """Per block, with P = exp(logits - lse): dV += P^T dO, dS = P (dO V^T - rowsum(dO O)),
    the bias parameters get dS through bias_fn; with a softcap dS *= 1 - tanh(s / cap)^2;
    dQ += scale dS K, dK += scale dS^T Q."""
    q, k, v, rule, params, out, lse = res
    f32 = jnp.float32
    n_q, n_k = q.shape[3] // st.bq, k.shape[2] // st.bk
    delta = jnp.sum(d_out * out, axis=-1)  # [B, K, G, Tp]

    def query_block(carry, i):
        dk, dv, dparams = carry
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * st.bq, st.bq, axis=3)  # noqa: E731
        q_i, do_i, lse_i, delta_i = take(q), take(d_out), take(lse), take(delta)

        def visit(j):  # this block's share of dq_i, dk, dv and the bias params' grads
            return _block_grads(st, q_i, do_i, lse_i, delta_i, k, v, rule, params, i, j)

        def skip(j):
            return jax.tree.map(jnp.zeros_like, jax.eval_shape(visit, j))

        def step(j, inner):
            # The cond passes only block-sized values: handed the whole dk and dv, XLA:CPU
            # copied them in and out at every block (fwd+bwd 1.8x slower when the
            # positions were not compile-time constants).
            dq_i, dk, dv, dparams = inner
            dq_j, dk_j, dv_j, d_bias = jax.lax.cond(_may_attend(st, rule, i, j), visit, skip, j)
            add = lambda total, part: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                total, jax.lax.dynamic_slice_in_dim(total, j * st.bk, st.bk, 2) + part,
                j * st.bk, 2)
            return (dq_i + dq_j, add(dk, dk_j), add(dv, dv_j),
                    jax.tree.map(jnp.add, dparams, d_bias))

        dq_i, dk, dv, dparams = jax.lax.fori_loop(
            0, _key_blocks(st, rule, i, n_k), step, (jnp.zeros(q_i.shape, f32), dk, dv, dparams))
        return (dk, dv, dparams), dq_i

    (dk, dv, dparams), dq = jax.lax.scan(
        query_block, (jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32), _zeros(params)),
        jnp.arange(n_q))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape)
    dparams = jax.tree.map(lambda d, x: d.astype(x.dtype), dparams, params)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            jax.tree.map(lambda x: None, rule), dparams)


_flash.defvjp(_flash_fwd, _flash_bwd)


def index_bias(terms, q_index, k_index):
    """A bias_fn for a materialised bias `terms` [B|1, N|1, Tq|1, Tk|1] whose positions
    are row and column indices: its block (size-1 axes stay whole)."""
    rows = terms if terms.shape[2] == 1 else jnp.take(terms, q_index[0], axis=2)
    return rows if terms.shape[3] == 1 else jnp.take(rows, k_index[0], axis=3)
