"""Randomized positions (Ruoss et al. 2023): what is drawn, per document, and when."""

import numpy as np
import pytest

from jaxformer.data.random_positions import randomize_batch
from jaxformer.model.config import ConfigError
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


def test_a_process_share_of_the_loop_batch_draws_what_one_host_draws(rng):
    """The training loop's batch (_Run.batch_at) for a process holding global rows
    k..k+m of a packed batch has exactly rows k..k+m of one host's batch at that step:
    get_batch over all rows, positions drawn by randomize_batch at (seed, step)."""
    from types import SimpleNamespace

    from jaxformer.data import ByteTokenizer, Dataset
    from jaxformer.training import loop
    b, t, top = 8, 24, int(rng.integers(24, 200))
    tokens = rng.integers(0, 256, 2000).astype(np.uint8)
    docs = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 2000), 150, replace=False))])
    data = Dataset(tokens, tokens, docs, docs, ByteTokenizer(), "test")
    seed, step = int(rng.integers(1 << 20)), int(rng.integers(1 << 20))
    cfg = RunConfig.from_dict({"data": {"pack": True}, "train": {
        "batch_size": b, "seq_len": t, "seed": seed, "random_positions": top}})
    k = int(rng.integers(1, b))  # a share that does not start at row 0
    rows = slice(k, k + int(rng.integers(1, b - k + 1)))
    run = SimpleNamespace(cfg=cfg, data=data, rows=rows, rollouts=None, place=lambda batch: batch)
    got = loop._Run.batch_at(run, step)
    one_host = data.train_batch(seed=seed, step=step, batch_size=b, seq_len=t, pack=True)
    want = randomize_batch(one_host, top, seed, step)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key][rows], err_msg=key)
    assert (want["positions"] != one_host["positions"]).any()  # the draw is on
