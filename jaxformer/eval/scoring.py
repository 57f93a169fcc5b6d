"""Batched, jitted scoring of token windows: the log-likelihood of each window's last
`n` tokens given the ones before, and whether greedy decoding would have produced them.

Windows are sorted by length and padded to a few bucketed shapes (rows: the batch size;
width: a power of two, capped at max_seq_len), so one evaluation compiles a handful of
programs; padding carries segment id 0 and is never attended to or scored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer.core.sharding import batch_devices, batch_sharding, traced_under

MIN_WIDTH = 16


def bucket(n: int, cap: int, low: int = MIN_WIDTH) -> int:
    """The padded width of a window of n tokens: the next power of two >= max(n, low),
    at most cap."""
    return min(cap, max(low, 1 << max(n - 1, 0).bit_length()))


def _score(model, params, tokens, targets, segment_ids, scored):
    """tokens, targets, segment_ids, scored [B, T] -> (sum of log p(target) over the scored
    positions [B] float32, all those targets the argmax [B] bool)."""
    logits = model.apply({"params": params}, tokens, None, segment_ids)  # [B, T, V] f32
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    target_logp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]  # [B, T]
    greedy = jnp.argmax(logits, -1) == targets                               # [B, T]
    return (jnp.sum(jnp.where(scored, target_logp, 0.0), -1),
            jnp.all(greedy | ~scored, -1))


class Scorer:
    """score(windows) for a loaded model (jaxformer.eval.loading.Loaded): one jitted
    program per bucketed shape, on the model's mesh."""

    def __init__(self, loaded, batch_size: int):
        self.loaded, self.max_len = loaded, loaded.model.cfg.max_seq_len
        split = batch_devices(loaded.mesh, loaded.rules)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = -(-batch_size // split) * split  # a multiple of the row split
        rows = batch_sharding(loaded.mesh, loaded.rules)
        fn = traced_under(loaded.mesh, loaded.rules, functools.partial(_score, loaded.model))
        shardings = jax.tree.map(lambda x: x.sharding, loaded.params)
        self._fn = jax.jit(fn, in_shardings=(shardings, rows, rows, rows, rows),
                           out_shardings=NamedSharding(loaded.mesh, P()))
        self.shapes: set[tuple[int, int]] = set()  # the shapes compiled so far

    def score(self, windows) -> list[tuple[float, bool]]:
        """windows: (tokens, n) pairs, tokens a sequence of ids of length 2..max_seq_len + 1
        whose last n (1 <= n < len) are scored given the ones before. Returns (log-likelihood,
        is_greedy) per window, in order."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        out: list = [None] * len(windows)
        for start in range(0, len(order), self.rows):
            chunk = order[start:start + self.rows]
            totals, greedy = self._batch([windows[i] for i in chunk])
            for j, i in enumerate(chunk):
                out[i] = (float(totals[j]), bool(greedy[j]))
        return out

    def _batch(self, windows):
        width = bucket(max(len(t) for t, _ in windows) - 1, self.max_len)
        arrays = np.zeros((4, self.rows, width), np.int32)  # tokens, targets, segments, scored
        for r, (toks, n) in enumerate(windows):
            toks = np.asarray(toks, np.int32)
            k = len(toks) - 1
            if not 1 <= n <= k <= self.max_len:
                raise ValueError(f"a window of {len(toks)} tokens scoring {n} does not fit "
                                 f"max_seq_len={self.max_len} (1 <= n < length <= "
                                 f"max_seq_len + 1)")
            arrays[0, r, :k], arrays[1, r, :k], arrays[2, r, :k] = toks[:-1], toks[1:], 1
            arrays[3, r, k - n:k] = 1
        self.shapes.add((self.rows, width))
        tokens, targets, segments, scored = arrays
        totals, greedy = self._fn(self.loaded.params, tokens, targets, segments,
                                  scored.astype(bool))
        return np.asarray(totals), np.asarray(greedy)
