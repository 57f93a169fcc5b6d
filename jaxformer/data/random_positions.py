"""Randomized positions (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
Generalization of Transformers"): in training, each sequence's positions are a sorted
random subset of [0, MAX) instead of 0..n-1, so a model trained on short sequences has
seen the positions of long ones; evaluation keeps 0..n-1.

`train.random_positions=MAX` turns it on. A packed row's documents (segments) each draw
their own subset, of their own length; padding keeps its positions. A row's draw is a
pure function of (seed, step, row), so a resumed run draws what the uninterrupted run
drew, and several hosts what one would.
"""

from __future__ import annotations

import numpy as np

STREAM = 0x5250  # the draws' random stream, apart from the batch sampler's


def random_positions(positions: np.ndarray, segment_ids: np.ndarray | None, max_position: int,
                     rngs) -> np.ndarray:
    """positions [B, T] (restarting at 0 at each document) replaced by, per document of
    n tokens, the sorted draw of n distinct integers from [0, max_position) (its token at
    position p takes the p-th smallest). segment_ids [B, T] (0 = padding, left as is) or
    None (each row one document). rngs: one np.random.Generator per row. int32 [B, T]."""
    out = np.array(positions, np.int32, copy=True)
    segments = np.ones_like(out) if segment_ids is None else np.asarray(segment_ids)
    for r, rng in zip(range(out.shape[0]), rngs):
        edges = np.flatnonzero(np.diff(segments[r]) != 0) + 1
        for doc in np.split(np.arange(out.shape[1]), edges):  # runs of one segment id
            if segments[r, doc[0]] == 0:
                continue
            n = int(out[r, doc].max()) + 1
            if n > max_position:
                raise ValueError(f"a document of {n} tokens cannot take {n} distinct positions "
                                 f"from [0, {max_position}); raise train.random_positions")
            draw = np.sort(rng.choice(max_position, size=n, replace=False))
            out[r, doc] = draw[out[r, doc]]
    return out


def randomize_batch(batch: dict, max_position: int | None, seed: int, step: int,
                    rows: slice = slice(None)) -> dict:
    """The batch with its positions drawn by random_positions, row i's from a generator
    seeded by (seed, step, i) alone; the batch as it is for max_position None (the
    setting off). rows: the batch's rows among the global batch's (a process's share on
    several hosts), so every host draws what one host would."""
    if max_position is None:
        return batch
    inputs = batch["inputs"]
    positions = batch.get("positions")
    if positions is None:
        positions = np.broadcast_to(np.arange(inputs.shape[-1], dtype=np.int32), inputs.shape)
    first = rows.start or 0
    rngs = (np.random.default_rng([STREAM, seed, step, first + i]) for i in range(len(inputs)))
    return {**batch, "positions": random_positions(np.asarray(positions),
                                                   batch.get("segment_ids"), max_position, rngs)}
