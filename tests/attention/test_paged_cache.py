"""The paged layout (jaxformer.attention.paged_cache): write_pages puts each row's new keys
at its logical indices in its pages (padding and indices past its table dropped), and
page_view reads a row's pages back in logical order as a cache layer's rows [R * K, S, H];
against a float64 NumPy pool written and read slot by slot."""

import jax
import numpy as np

from jaxformer.attention.paged_cache import page_view, write_pages

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
