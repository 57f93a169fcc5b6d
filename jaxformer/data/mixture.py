"""data.mixture: a weighted mixture of corpora. Each source is any corpus data.path takes,
tokenised and cached on its own (jaxformer.data.dataset); every row of a training batch
comes from a source drawn with the mixture's weights, a pure function of (seed, step,
row), so a resumed or multi-host run reads the rows it would have read. Evaluation reports
each source's validation loss (val_loss/NAME, NAME the file's stem) and their mean under
the weights.

    data.mixture=code.txt:0.8,prose.jsonl:0.2      (or a YAML list of PATH:WEIGHT)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import numpy as np

from jaxformer.data.batches import get_batch
from jaxformer.data.config import DataConfig, DataError, parse_mixture


def row_sources(seed: int, step: int, batch_size: int, weights) -> np.ndarray:
    """The source of each row of step `step`'s batch [batch_size], from the random stream
    (seed, step, 0): systematic sampling (one uniform offset, then evenly spaced points
    through the weights' cumulative shares), rows shuffled. Each source gets floor or ceil
    of weight x batch_size rows, weight x batch_size on average, so the shares over a run
    stay within a row per batch of the weights. A source's windows come from the stream
    (seed, step, 1 + i)."""
    rng = np.random.default_rng([seed, step, 0])
    u = (rng.random() + np.arange(batch_size)) / batch_size
    edges = np.cumsum(weights) / np.sum(weights)
    picks = np.minimum(np.searchsorted(edges, u, side="right"), len(weights) - 1)
    return picks[rng.permutation(batch_size)]


@dataclasses.dataclass
class Part:
    name: str
    weight: float
    data: object  # a jaxformer.data.Dataset


@dataclasses.dataclass
class MixtureData:
    """The mixture's sources; answers the loop's batch calls as jaxformer.data.Dataset
    does, and `parts` for the per-source evaluation."""

    parts: list[Part]
    tokenizer: object

    @property
    def source(self) -> str:
        return "a mixture of " + ", ".join(f"{p.name} ({p.weight:g}: {p.data.source})"
                                           for p in self.parts)

    @property
    def token_counts(self) -> tuple[int, int]:
        return tuple(sum(p.data.token_counts[i] for p in self.parts) for i in (0, 1))

    def train_batch(self, *, seed: int, step: int, batch_size: int, seq_len: int,
                    pack: bool = False, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Each row's window from the source row_sources draws for it; `rows`: this
        process's rows of the batch."""
        choice = row_sources(seed, step, batch_size, [p.weight for p in self.parts])
        mine = np.arange(batch_size)[rows]
        out: dict[str, np.ndarray] = {}
        for i, part in enumerate(self.parts):
            here = np.flatnonzero(choice[mine] == i)  # positions among this process's rows
            if not here.size:
                continue
            d = part.data
            batch = get_batch(d.train, d.train_docs, seed=seed, step=step, batch_size=batch_size,
                              seq_len=seq_len, pack=pack, rows=mine[here], stream=1 + i)
            for key, value in batch.items():
                if key not in out:
                    out[key] = np.zeros((len(mine), *value.shape[1:]), value.dtype)
                out[key][here] = value
        return out

    def eval_batches(self, **kw) -> Iterator[dict[str, np.ndarray]]:
        """Every source's validation batches in turn (the per-source losses: `parts`)."""
        for part in self.parts:
            yield from part.data.eval_batches(**kw)


def load_mixture(cfg: DataConfig, load, **kw) -> MixtureData:
    """Each source loaded as data.path=PATH would be (`load`: load_dataset), with one
    tokenizer for all."""
    sources = parse_mixture(cfg.mixture)
    for _, path, _ in sources:  # before any source is tokenised
        if not os.path.exists(os.path.expanduser(path)):
            raise DataError(f"data.mixture entry {path!r} does not exist; point it at a "
                            "text/.jsonl/.parquet/.bin file or a folder")
    parts = [Part(name, weight, load(cfg.replace(path=path, mixture=None), **kw))
             for name, path, weight in sources]
    prints = {p.data.tokenizer.fingerprint for p in parts}
    if len(prints) > 1:
        raise DataError("data.mixture's sources come with different tokenizers ("
                        + ", ".join(f"{p.name}: {p.data.tokenizer!r}" for p in parts)
                        + "); prepare them with one tokenizer")
    return MixtureData(parts, parts[0].data.tokenizer)
