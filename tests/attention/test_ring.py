"""jaxformer.attention.ring on one device: the ring is a vmap over the sequence's chunks
with a named axis (ppermute and axis_size run there as over a mesh axis), so ring_attention
and gathered_attention over n = 1..4 chunks in zigzag order, with packed segments, a
window and sinks, equal float64 NumPy attention of the whole sequence in its own order,
and so do their gradients (the ring's custom backward); _merge of two partial results
equals the softmax over their union; the inverse of zigzag_order restores the sequence.
(The zigzag order itself, zigzag_batch and the ring over a real mesh are
tests/core/test_sharding.py's.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.attention.masks import MaskRule
from jaxformer.attention.ring import _merge, gathered_attention, ring_attention, zigzag_order
from tests.attention.reference import (np_attention, np_attention_grads, np_causal, np_segment,
                                       np_window, packed_segments, positions_in_segments)


def test_zigzag_inverse_restores_the_sequence(rng):
    for n in (1, 2, 3, 4):
        t = 2 * n * int(rng.integers(1, 5))
        order = zigzag_order(t, n)
        inverse = np.argsort(order)
        x = rng.normal(size=t)
        np.testing.assert_array_equal(x[order][inverse], x)
        # device d's share: chunks d and 2n - 1 - d, each in order
        c = t // (2 * n)
        for d, share in enumerate(order.reshape(n, -1)):
            want = np.r_[np.arange(d * c, (d + 1) * c), np.arange((2 * n - 1 - d) * c,
                                                                   (2 * n - d) * c)]
            np.testing.assert_array_equal(share, want)


def test_merge_of_two_partial_softmaxes_is_the_softmax_of_their_union(rng):
    logits = rng.normal(size=(3, 9)) * 3
    v = rng.normal(size=(9, 4))
    cut = int(rng.integers(1, 8))
    logits[0, :cut] = -np.inf  # a row that sees nothing in the first part
    parts = []
    for sl in (slice(0, cut), slice(cut, 9)):
        x = logits[:, sl]
        with np.errstate(divide="ignore", invalid="ignore"):  # the row that sees nothing
            lse = np.log(np.exp(x).sum(-1))
            w = np.nan_to_num(np.exp(x - lse[:, None]))
        parts += [jnp.asarray(w @ v[sl], jnp.float32), jnp.asarray(lse, jnp.float32)]
    out, lse = _merge(*parts)
    lse_all = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(lse, lse_all, rtol=1e-5)
    np.testing.assert_allclose(out, np.exp(logits - lse_all[:, None]) @ v, rtol=1e-4, atol=1e-5)
    empty = jnp.full(3, -jnp.inf)  # nothing on either side stays nothing, not NaN
    out, lse = _merge(jnp.zeros((3, 4)), empty, jnp.zeros((3, 4)), empty)
    assert np.isneginf(lse).all() and (np.asarray(out) == 0).all()


def chunked(x, order, n):
    """[B, T, ...] in zigzag order, split into n chunks: [n, B, T / n, ...]."""
    x = jnp.take(jnp.asarray(x), order, axis=1)
    return jnp.moveaxis(x.reshape(x.shape[0], n, -1, *x.shape[2:]), 1, 0)


def whole(x, order):
    """[n, B, T / n, ...] back to [B, T, ...] in the sequence's order."""
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape(x.shape[0], -1, *x.shape[3:])
    return np.asarray(jnp.take(x, np.argsort(order), axis=1), np.float64)


@pytest.mark.parametrize("fn", [ring_attention, gathered_attention])
@pytest.mark.parametrize("n, heads, window, sinks", [(1, (4, 2), None, False),
                                                      (2, (4, 4), 3, False),
                                                      (4, (4, 1), None, True)])
def test_split_attention_equals_whole_sequence_attention(rng, fn, n, heads, window, sinks):
    b, t, h = 2, 8, 4
    (nq, nk), order = heads, zigzag_order(t, n)
    q, k, v, d_out = (rng.normal(size=(b, t, m, h)).astype(np.float32)
                      for m in (nq, nk, nk, nq))
    seg = packed_segments(rng, b, t)
    pos = positions_in_segments(seg)
    sink = rng.normal(size=nq).astype(np.float32) if sinks else None
    mask = np_causal(pos, pos) & np_segment(seg, seg)
    if window:
        mask &= np_window(pos, pos, window)

    def local(q, k, v, pos, seg, sink):
        rule = MaskRule(q_positions=pos, k_positions=pos, q_segment_ids=seg, k_segment_ids=seg,
                        causal=True, window=window)
        return fn(q, k, v, rule, axis="context", sinks=sink)

    def run(q, k, v, sink):
        args = [chunked(x, order, n) for x in (q, k, v, pos, seg)]
        return jax.vmap(local, in_axes=(0, 0, 0, 0, 0, None), axis_name="context")(*args, sink)

    _, want = np_attention(q, k, v, mask=mask, sinks=sink)
    np.testing.assert_allclose(whole(run(q, k, v, sink), order), want, rtol=2e-4, atol=2e-5)

    def local_grads(q, k, v, pos, seg, d_out, sink):  # each device its own queries' loss
        loss = lambda *a: jnp.sum(local(*a[:3], pos, seg, a[3]) * d_out)  # noqa: E731
        return jax.grad(loss, (0, 1, 2, 3) if sinks else (0, 1, 2))(q, k, v, sink)

    args = [chunked(x, order, n) for x in (q, k, v, pos, seg, d_out)]
    got = jax.vmap(local_grads, in_axes=(0,) * 6 + (None,), axis_name="context")(*args, sink)
    got = [whole(g, order) for g in got[:3]] + [np.asarray(g).sum(0) for g in got[3:]]
    ref = np_attention_grads(q, k, v, d_out, mask, np.zeros((1, 1, 1, 1)), sinks=sink)
    want = ref[:3] + ref[4:]
    for name, g, w in zip("qkvs", got, want):
        np.testing.assert_allclose(g, w, rtol=5e-4, atol=5e-5, err_msg=name)

