"""Batches of windows of a token stream: random for training, sequential for evaluation.

Every batch is a dict of NumPy arrays, B = batch_size, T = seq_len:
  inputs      int32   [B, T]  tokens[s : s + T] for each row's window start s
  targets     int32   [B, T]  tokens[s + 1 : s + T + 1] (inputs shifted by one)
  loss_mask   float32 [B, T]  1, except with pack: 0 where the target is the first token
                              of a new document (it cannot be predicted from the last one)
and with pack only:
  segment_ids int32   [B, T]  1, 2, 3, ... for the documents met along the row (never 0:
                              windows are full, there is no padding)
  positions   int32   [B, T]  restart at 0 at each document start; the row's first,
                              partial document starts at 0 too
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from jaxformer.data.errors import DataError


def get_batch(tokens: np.ndarray, docs: np.ndarray | None, *, seed: int, step: int,
              batch_size: int, seq_len: int, pack: bool = False,
              rows: slice = slice(None), stream: int | None = None) -> dict[str, np.ndarray]:
    """A training batch that is a pure function of (seed, step): no iterator state, so a
    resumed run draws exactly the batches it would have drawn. Window starts are uniform
    in [0, len(tokens) - seq_len - 1]. docs: int64 [n_docs] document start offsets.
    rows: only these rows of the batch are read (a process's share on several hosts; a
    slice or row indices). stream: another random stream of the same (seed, step) (a
    mixture's source: jaxformer.data.mixture)."""
    _check(tokens, docs, batch_size, seq_len, pack, need=seq_len + 1,
           what=f"one window of seq_len={seq_len} (+1 for the last target)")
    rng = np.random.default_rng([seed, step] if stream is None else [seed, step, stream])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size, endpoint=True)
    return _windows(tokens, docs, starts[rows], seq_len, pack)


def eval_batches(tokens: np.ndarray, docs: np.ndarray | None, *, batch_size: int,
                 seq_len: int, max_batches: int | None = None, pack: bool = False,
                 rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
    """Non-overlapping windows from the start of the split (window i starts at i * seq_len),
    batch_size at a time; a last partial batch is dropped. Raises DataError at once when
    the split holds less than one batch. rows: only these rows of each batch are read."""
    _check(tokens, docs, batch_size, seq_len, pack, need=batch_size * seq_len + 1,
           what=f"one batch of batch_size={batch_size} windows of seq_len={seq_len} (+1)")
    n_batches = (len(tokens) - 1) // seq_len // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)

    def batches():
        for b in range(n_batches):
            starts = (b * batch_size + np.arange(batch_size))[rows] * seq_len
            yield _windows(tokens, docs, starts, seq_len, pack)

    return batches()


def _windows(tokens, docs, starts: np.ndarray, seq_len: int, pack: bool) -> dict[str, np.ndarray]:
    rows = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)  # [B, T+1]
    batch = {"inputs": np.ascontiguousarray(rows[:, :-1]),
             "targets": np.ascontiguousarray(rows[:, 1:])}
    if not pack:
        batch["loss_mask"] = np.ones(batch["inputs"].shape, np.float32)
        return batch
    pos = starts[:, None] + np.arange(seq_len + 1)                      # [B, T+1] in tokens
    doc = np.searchsorted(docs, pos, side="right") - 1                  # [B, T+1] doc index
    first = np.maximum(np.asarray(docs)[doc[:, :-1]], starts[:, None])  # [B, T] segment start
    batch["segment_ids"] = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
    batch["positions"] = (pos[:, :-1] - first).astype(np.int32)
    batch["loss_mask"] = (doc[:, 1:] == doc[:, :-1]).astype(np.float32)
    return batch


def _check(tokens, docs, batch_size: int, seq_len: int, pack: bool, need: int,
           what: str) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if len(tokens) < need:
        raise DataError(f"the split has {len(tokens)} tokens, but {what} needs {need}; "
                        "lower seq_len (or batch_size), or add data (or raise "
                        "data.val_fraction for the val split)")
    if pack and (docs is None or len(docs) == 0 or docs[0] != 0):
        raise DataError("pack=True needs the split's document offsets starting at 0 "
                        "(Dataset.train_docs / val_docs)")
