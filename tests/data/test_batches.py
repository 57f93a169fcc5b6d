"""get_batch and eval_batches (jaxformer.data.batches) against token-by-token windows."""

import numpy as np
import pytest

from jaxformer.data import DataError, eval_batches, get_batch


# ---- batches ------------------------------------------------------------------------------

def reference_pack(docs, start, seq_len):
    """segment_ids, positions, loss_mask of the window at `start`, one token at a time."""
    def doc_of(p):
        return max(i for i, d in enumerate(docs) if d <= p)
    seg, pos, mask = [], [], []
    for t in range(seq_len):
        p = start + t
        seg.append(doc_of(p) - doc_of(start) + 1)
        pos.append(p - max(docs[doc_of(p)], start))
        mask.append(1.0 if doc_of(p + 1) == doc_of(p) else 0.0)
    return seg, pos, mask


def random_docs(rng, n):
    lengths = rng.integers(1, 20, n)  # many documents of 1 token, many boundaries per window
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), int(lengths.sum())


def test_get_batch_pure_and_real_slices(rng):
    n, B, T = int(rng.integers(500, 2000)), 4, 16
    tokens = np.arange(n, dtype=np.uint32)  # a row's first id is its window start
    seed = int(rng.integers(0, 2**31))
    kw = dict(seed=seed, batch_size=B, seq_len=T)
    b5 = get_batch(tokens, None, step=5, **kw)
    for k in range(5):
        get_batch(tokens, None, step=k, **kw)
    again = get_batch(tokens, None, step=5, **kw)
    assert set(b5) == {"inputs", "targets", "loss_mask"}
    for key in b5:
        np.testing.assert_array_equal(b5[key], again[key])
    assert not np.array_equal(b5["inputs"], get_batch(tokens, None, step=6, **kw)["inputs"])
    other_seed = get_batch(tokens, None, step=5, **{**kw, "seed": seed + 1})
    assert not np.array_equal(b5["inputs"], other_seed["inputs"])
    assert b5["inputs"].dtype == np.int32 and b5["inputs"].shape == (B, T)
    assert b5["loss_mask"].dtype == np.float32 and (b5["loss_mask"] == 1).all()
    for row_in, row_tg in zip(b5["inputs"], b5["targets"]):
        s = int(row_in[0])
        assert 0 <= s <= n - T - 1
        assert row_in.tolist() == tokens[s:s + T].tolist()
        assert row_tg.tolist() == tokens[s + 1:s + T + 1].tolist()
    # every start in [0, n - T - 1] is drawn, none outside
    short = np.arange(T + 3, dtype=np.uint16)
    starts = {int(s) for k in range(60)
              for s in get_batch(short, None, step=k, **kw)["inputs"][:, 0]}
    assert starts == {0, 1, 2}


def test_get_batch_packing_against_reference(rng):
    docs, n = random_docs(rng, 300)
    tokens = rng.integers(0, 256, n).astype(np.uint16)
    kw = dict(seed=int(rng.integers(0, 1000)), step=int(rng.integers(0, 1000)),
              batch_size=6, seq_len=32)
    packed, plain = get_batch(tokens, docs, pack=True, **kw), get_batch(tokens, docs, **kw)
    np.testing.assert_array_equal(packed["inputs"], plain["inputs"])
    np.testing.assert_array_equal(packed["targets"], plain["targets"])
    assert "segment_ids" not in plain and "positions" not in plain
    for key in ("segment_ids", "positions"):
        assert packed[key].dtype == np.int32
    # recover each row's start by matching its tokens (and targets) against the stream
    for b in range(kw["batch_size"]):
        row = packed["inputs"][b].tolist() + [packed["targets"][b, -1]]
        start = next(s for s in range(n - 32) if tokens[s:s + 33].tolist() == row)
        seg, pos, mask = reference_pack(docs.tolist(), start, 32)
        assert packed["segment_ids"][b].tolist() == seg
        assert packed["positions"][b].tolist() == pos
        assert packed["loss_mask"][b].tolist() == mask
    assert packed["loss_mask"].min() == 0 and packed["segment_ids"].max() > 2


def test_eval_batches_deterministic_and_covering(rng):
    docs, n = random_docs(rng, int(rng.integers(100, 200)))
    tokens = rng.integers(0, 256, n).astype(np.uint16)
    B, T = 3, 8
    batches = list(eval_batches(tokens, docs, batch_size=B, seq_len=T, pack=True))
    again = list(eval_batches(tokens, docs, batch_size=B, seq_len=T, pack=True))
    assert len(batches) == (n - 1) // T // B > 0
    for x, y in zip(batches, again):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    covered = len(batches) * B * T
    inputs = np.concatenate([b["inputs"] for b in batches]).reshape(-1)
    targets = np.concatenate([b["targets"] for b in batches]).reshape(-1)
    assert inputs.tolist() == tokens[:covered].tolist()
    assert targets.tolist() == tokens[1:covered + 1].tolist()
    for i, (b, r) in enumerate((b, r) for b in batches for r in range(B)):
        seg, pos, mask = reference_pack(docs.tolist(), i * T, T)
        assert (b["segment_ids"][r].tolist(), b["positions"][r].tolist(),
                b["loss_mask"][r].tolist()) == (seg, pos, mask)
    assert len(list(eval_batches(tokens, docs, batch_size=B, seq_len=T, max_batches=2))) == 2
    with pytest.raises(DataError, match=f"split has {n} tokens.*needs {4 * n + 1}.*lower seq_len"):
        eval_batches(tokens, docs, batch_size=4, seq_len=n)  # raised at the call
    with pytest.raises(DataError, match="split has 5 tokens.*seq_len=8.*needs 9"):
        get_batch(tokens[:5], None, seed=0, step=0, batch_size=1, seq_len=8)
    with pytest.raises(DataError, match="pack=True needs"):
        get_batch(tokens, None, seed=0, step=0, batch_size=1, seq_len=8, pack=True)
