"""(source, target) pairs (data.format=seq2seq) for an encoder-decoder
(model.arch=encoder_decoder).

Each JSONL line (or Parquet row) holds the text fields data.source_field and
data.target_field; a record missing one is a DataError naming the record (its line) and
the field. data.path may instead name a generated task (jaxformer.data.seq2seq_tasks). One id marks a target's start and its end (the decoder's first input and its
last target, as BART's decoder starts from its end token): the tokenizer's end-of-text id,
or, for a tokenizer without one (bytes), the first id past its own (256: the model needs
vocab_size > 256).

Pairs are packed whole, in order, on both sides at once: a row of seq_len source tokens
and one of seq_len target inputs hold the same pairs, pair k as segment k on each side
(positions restarting at 0; segment 0: padding), so that a target's cross-attention sees
its own source alone. Arrays of a batch: sources, source_segment_ids, source_positions
[B, seq_len] (the encoder's), inputs ([end] + target), targets (target + [end]),
segment_ids, positions, loss_mask [B, seq_len] (the decoder's). A source longer than
seq_len, or a target longer than seq_len - 1, is cut (counted in the log). Every
data.val_fraction-th pair (spread evenly) is held out. Batches are a pure function of
(seed, step), as jaxformer.data.completions' are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxformer.data.completions import Records, read_fields
from jaxformer.data.errors import DataError
from jaxformer.data.settings import Settings, check_field_names


@dataclasses.dataclass(frozen=True)
class Seq2SeqSettings(Settings):
    """data.format=seq2seq: the record fields of the source and the target (a generated
    task of jaxformer.data.seq2seq_tasks writes these defaults)."""

    source_field: str = "source"
    target_field: str = "target"

    def __post_init__(self):
        check_field_names(self)


def end_id(tokenizer) -> int:
    """The id that starts and ends a target: the tokenizer's end-of-text, else the first
    id past its vocabulary."""
    return tokenizer.vocab_size if tokenizer.eot_id is None else tokenizer.eot_id


def as_records(texts, tokenizer) -> Records:
    """Texts tokenised one after another (weights: all 1)."""
    ids = [np.asarray(tokenizer.encode(t), np.int32) for t in texts]
    lengths = [len(x) for x in ids]
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    return Records(tokens.astype(np.int32), np.ones(len(tokens), np.uint8),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def pack_pairs(sources: Records, targets: Records, seq_len: int) -> tuple[np.ndarray, int]:
    """Row boundaries int64 [n_rows + 1] (pair indices), each row's pairs fitting seq_len
    on both sides (a source cut to seq_len, a target to seq_len - 1, plus its start), and
    how many pairs were cut."""
    src = np.diff(sources.offsets)
    tgt = np.diff(targets.offsets) + 1  # the start token, or the end one among the targets
    cut = int(np.sum((src > seq_len) | (tgt > seq_len)))
    src, tgt = np.minimum(src, seq_len), np.minimum(tgt, seq_len)
    bounds, used_s, used_t = [0], 0, 0
    for i, (s, t) in enumerate(zip(src, tgt)):
        if used_s + s > seq_len or used_t + t > seq_len:
            bounds.append(i)
            used_s = used_t = 0
        used_s, used_t = used_s + s, used_t + t
    if len(src):
        bounds.append(len(src))
    return np.asarray(bounds, np.int64), cut


ARRAYS = ("sources", "source_segment_ids", "source_positions", "inputs", "targets",
          "segment_ids", "positions")  # a batch's int32 arrays [B, T] (and loss_mask)


def pairs_batch(sources: Records, targets: Records, bounds, rows, seq_len: int, end: int):
    """The batch of packed rows `rows` (the module docstring's arrays: ARRAYS, loss_mask)."""
    out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ARRAYS}
    out["loss_mask"] = np.zeros((len(rows), seq_len), np.float32)
    for r, row in enumerate(rows):
        at_s = at_t = 0
        for seg, i in enumerate(range(bounds[row], bounds[row + 1]), 1):
            src = sources.tokens[sources.offsets[i]:sources.offsets[i + 1]][:seq_len]
            tgt = targets.tokens[targets.offsets[i]:targets.offsets[i + 1]][:seq_len - 1]
            n, m = len(src), len(tgt) + 1
            out["sources"][r, at_s:at_s + n] = src
            out["source_segment_ids"][r, at_s:at_s + n] = seg
            out["source_positions"][r, at_s:at_s + n] = np.arange(n)
            out["inputs"][r, at_t:at_t + m] = np.concatenate([[end], tgt])
            out["targets"][r, at_t:at_t + m] = np.concatenate([tgt, [end]])
            out["segment_ids"][r, at_t:at_t + m] = seg
            out["positions"][r, at_t:at_t + m] = np.arange(m)
            out["loss_mask"][r, at_t:at_t + m] = 1.0
            at_s, at_t = at_s + n, at_t + m
    return out


@dataclasses.dataclass
class Seq2SeqData:
    """The train and val pairs, packed per seq_len on first use; answers the loop's batch
    calls as jaxformer.data.Dataset does. train, val: (sources, targets) Records."""

    train: tuple[Records, Records]
    val: tuple[Records, Records]
    tokenizer: object
    source: str
    log: object = print
    _bounds: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return end_id(self.tokenizer)

    @property
    def token_counts(self) -> tuple[int, int]:
        return tuple(sum(len(r.tokens) for r in split) for split in (self.train, self.val))

    @property
    def max_id(self) -> int:
        """The largest token id of every source and target (0 when empty)."""
        return int(max(r.tokens.max(initial=0) for r in (*self.train, *self.val)))

    def packed(self, split: str, seq_len: int) -> np.ndarray:
        if (split, seq_len) not in self._bounds:
            bounds, cut = pack_pairs(*getattr(self, split), seq_len)
            if cut:
                self.log(f"data: {cut} {split} pairs have a source longer than seq_len={seq_len} "
                         f"or a target longer than {seq_len - 1} tokens, and are cut to it")
            self._bounds[split, seq_len] = bounds
        return self._bounds[split, seq_len]

    def train_batch(self, *, seed: int, step: int, batch_size: int, seq_len: int,
                    pack: bool = True, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        bounds = self.packed("train", seq_len)
        if len(bounds) < 2:
            raise DataError(f"{self.source}: no training pairs")
        picked = np.random.default_rng([seed, step]).integers(0, len(bounds) - 1, batch_size)
        return pairs_batch(*self.train, bounds, picked[rows], seq_len, self.end)

    def eval_batches(self, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                     pack: bool = True, rows: slice = slice(None)):
        bounds = self.packed("val", seq_len)
        n = (len(bounds) - 1) // batch_size
        if n == 0:
            raise DataError(f"{self.source}: the val split packs into {len(bounds) - 1} rows of "
                            f"seq_len={seq_len}, fewer than batch_size={batch_size}; raise "
                            "data.val_fraction or lower train.batch_size")
        n = n if max_batches is None else min(n, max_batches)
        return (pairs_batch(*self.val, bounds, (b * batch_size + np.arange(batch_size))[rows],
                            seq_len, self.end) for b in range(n))


def load_pairs(cfg, tokenizer, vocab_size: int | None, log=print) -> Seq2SeqData:
    """The pairs file cfg.path (cfg: a DataConfig), tokenised and split; the end id
    checked against the model."""
    fields = cfg.format_settings
    pairs = [values for _, values in read_fields(cfg.path, dict(fields.by_key()))]
    if not pairs:
        raise DataError(f"{cfg.path} holds no pairs; each line needs the fields "
                        f"{fields.source_field!r} and {fields.target_field!r}")
    end = end_id(tokenizer)
    if vocab_size is not None and end >= vocab_size:
        raise DataError(f"data.format=seq2seq marks a target's start and end with id {end} "
                        f"(past {tokenizer!r}'s ids), but model.vocab_size={vocab_size}; set "
                        f"model.vocab_size >= {end + 1}")
    i = np.arange(len(pairs))
    val = np.floor((i + 1) * cfg.val_fraction) > np.floor(i * cfg.val_fraction)
    split = lambda keep: tuple(as_records([p[j] for p, k in zip(pairs, keep) if k], tokenizer)  # noqa: E731
                               for j in (0, 1))
    return Seq2SeqData(split(~val), split(val), tokenizer,
                       f"seq2seq pairs {cfg.path} ({len(pairs):,}: {int((~val).sum()):,} train, "
                       f"{int(val.sum()):,} val)", log)
