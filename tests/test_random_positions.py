"""Randomized positions (Ruoss et al. 2023): what is drawn, per document, and when."""

import numpy as np
import pytest

from jaxformer.config import ConfigError
from jaxformer.data.random_positions import randomize_batch
from jaxformer.positions import segment_positions
from jaxformer.training.config import RunConfig


def packed_batch(rng, rows=3, t=40):
    """Rows of random documents (segments 1, 2, ...) with a padded tail on the last row."""
    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, t), 3, replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(t), side="right") + 1
    seg[-1, -5:] = 0
    return {"inputs": np.zeros((rows, t), np.int32), "segment_ids": seg,
            "positions": np.asarray(segment_positions(seg))}


def test_each_document_gets_sorted_distinct_positions_below_max(rng):
    batch, top = packed_batch(rng), int(rng.integers(40, 200))
    seed, step = int(rng.integers(1 << 20)), int(rng.integers(1 << 20))
    got = randomize_batch(batch, top, seed, step)["positions"]
    seg = batch["segment_ids"]
    for r in range(len(seg)):
        for s in set(seg[r]) - {0}:
            doc = got[r][seg[r] == s]
            assert (np.diff(doc) > 0).all() and doc.min() >= 0 and doc.max() < top, doc
    np.testing.assert_array_equal(got[seg == 0], batch["positions"][seg == 0])  # padding
    again = randomize_batch(batch, top, seed, step)["positions"]
    np.testing.assert_array_equal(got, again)  # a pure function of (seed, step): resumable
    for other in (randomize_batch(batch, top, seed, step + 1),
                  randomize_batch(batch, top, seed + 1, step)):
        assert (other["positions"] != got).any()
    half = {k: v[1:] for k, v in batch.items()}  # a host's rows draw what one host would
    np.testing.assert_array_equal(randomize_batch(half, top, seed, step, slice(1, 3))
                                  ["positions"], got[1:])


def test_unpacked_rows_draw_one_subset_each(rng):
    batch = {"inputs": np.zeros((4, 16), np.int32)}
    got = randomize_batch(batch, 1000, 0, int(rng.integers(1 << 20)))["positions"]
    assert got.shape == (4, 16) and (np.diff(got, axis=1) > 0).all() and got.max() < 1000
    assert len({tuple(row) for row in got}) == 4
    # at MAX = T the only subset is 0..T-1
    np.testing.assert_array_equal(randomize_batch(batch, 16, 0, 0)["positions"],
                                  np.broadcast_to(np.arange(16), (4, 16)))


def test_bad_maximum_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="random_positions=32 is less than train.seq_len=64"):
        RunConfig.from_dict({"train": {"seq_len": 64, "random_positions": 32}})
    with pytest.raises(ConfigError, match="random_positions=512 exceeds model.max_seq_len=256, "
                       "the learned position table"):
        RunConfig.from_dict({"model": {"position": "learned", "max_seq_len": 256},
                             "train": {"seq_len": 64, "random_positions": 512}})
