"""The paged layout (jaxformer.attention.paged_cache): write_pages puts each row's new keys
at its logical indices in its pages (padding and indices past its table dropped), and
page_view reads a row's pages back in logical order as a cache layer's rows [R * K, S, H];
against a float64 NumPy pool written and read slot by slot. pair_attention (a decode step
over each row's own pages, read as (row, page) pairs) equals float64 attention over each
row's keys in order, with a window, a bias, a soft-cap and sinks."""

import jax
import numpy as np

from jaxformer.attention.paged_cache import page_view, pair_attention, write_pages
from tests.attention.reference import np_attention

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
P, K, PS, H, R, M, T = 9, 2, 4, 3, 3, 3, 5  # pages, heads, page size, width, rows, table, new


@jax.jit
def written_view(pool, table, starts, counts, new):
    layer = write_pages({"k": pool, "v": pool, "page_table": table, "starts": starts,
                         "counts": counts}, new, new)
    return layer["k"], page_view(layer["k"], table)


def test_rows_write_their_logical_slots_and_read_their_pages_in_order():
    pool = rng.standard_normal((P, K, PS, H)).astype(np.float32)
    table = rng.permutation(P)[:R * M].reshape(R, M).astype(np.int32)  # distinct pages
    starts = rng.integers(0, M * PS - 2, R).astype(np.int32)
    counts = rng.integers(0, T + 1, R).astype(np.int32)
    new = rng.standard_normal((R, T, K, H)).astype(np.float32)  # [R, T, K, H]
    want = pool.astype(np.float64)
    for r in range(R):
        for t in range(counts[r]):
            j = starts[r] + t  # logical index: page j // PS of the row, offset j % PS
            if j < M * PS:
                want[table[r, j // PS], :, j % PS] = new[r, t]
    view = np.stack([want[table[r]].transpose(1, 0, 2, 3).reshape(K, M * PS, H)
                     for r in range(R)]).reshape(R * K, M * PS, H)  # [R * K, M * PS, H]
    got_pool, got_view = written_view(pool, table, starts, counts, new)
    np.testing.assert_allclose(np.asarray(got_pool), want, rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_view), view, rtol=0, atol=1e-7)


def test_pair_attention_is_each_rows_attention_over_its_own_pages():
    """Rows of 0..3 pages of 4 (one empty), K=2 heads of G=3 queries; the pairs in row
    order, padded with pairs of row R; each query at its row's last position, a window of
    w, an ALiBi-like bias, a soft-cap and sinks: each row as float64 attention over its own
    keys in logical order (a row without keys: zeros)."""
    n, pool_pages, window = 6, 16, int(rng.integers(3, 12))
    lengths = np.array([0, *rng.integers(1, 13, R)], np.int64)  # tokens a row holds
    held = -(-lengths // PS)
    pages = rng.permutation(pool_pages)
    row = np.repeat(np.arange(len(held)), held)
    index = np.arange(len(row)) - np.repeat(np.cumsum(held) - held, held)
    pad = 3
    pair_row = np.concatenate([row, np.full(pad, len(held))]).astype(np.int32)
    pair_page = np.concatenate([pages[:len(row)], np.full(pad, pool_pages)]).astype(np.int32)
    pair_index = np.concatenate([index, np.zeros(pad, np.int64)]).astype(np.int32)
    k = rng.standard_normal((pool_pages, K, PS, H)).astype(np.float32)
    v = rng.standard_normal((pool_pages, K, PS, H)).astype(np.float32)
    q = rng.standard_normal((len(held), 1, n, H)).astype(np.float32)
    slopes = rng.uniform(0.1, 1.0, n)
    softcap, sinks = 2.0, rng.standard_normal(n).astype(np.float32)
    q_pos = np.maximum(lengths - 1, 0)[pair_row.clip(0, len(held) - 1)]  # [P]
    k_pos = pair_index[:, None] * PS + np.arange(PS)  # [P, PS]
    held_pos = np.append(lengths, 0)[pair_row]
    mask = (k_pos < held_pos[:, None]) & (q_pos[:, None] - k_pos < window)
    bias = slopes[None, :, None, None] * (k_pos - q_pos[:, None])[:, None, None, :]
    layer = {"k": k, "v": v, "pair_row": pair_row, "pair_page": pair_page,
             "pair_index": pair_index}
    got = jax.jit(lambda q, layer, m, b: pair_attention(q, layer, m, b, softcap=softcap,
                                                        sinks=sinks))(
        q, layer, mask[:, None, None, :], bias.astype(np.float32))
    for r, length in enumerate(lengths):
        if length == 0:
            np.testing.assert_array_equal(np.asarray(got[r]), 0.0)
            continue
        mine = pages[:len(row)][row == r]  # the row's pages in order
        keys = k[mine].transpose(1, 0, 2, 3).reshape(K, -1, H)[:, :length].transpose(1, 0, 2)
        values = v[mine].transpose(1, 0, 2, 3).reshape(K, -1, H)[:, :length].transpose(1, 0, 2)
        p = np.arange(length)
        want = np_attention(q[r:r + 1], keys[None], values[None],
                            mask=(length - 1 - p < window)[None, None, None, :],
                            bias=(slopes[:, None] * (p - (length - 1)))[None, :, None, :],
                            softcap=softcap, sinks=sinks)[1]
        np.testing.assert_allclose(np.asarray(got[r]), want[0], rtol=2e-5, atol=2e-6)
