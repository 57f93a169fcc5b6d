"""Prompt/completion records (data.format=prompt_completion): the loss on the completion.

Each JSONL line (or Parquet row) holds a prompt and a completion (fields
data.prompt_field, data.completion_field). A record is tokenised as prompt + completion
(+ the tokenizer's end-of-text id, when it has one, so the model learns to stop), and
its targets count only where the token predicted is a completion token (or the end).
Records are packed whole, in order, into rows of seq_len inputs: each record's inputs
are its tokens but the last, its targets the tokens but the first, its segment id its
place in the row (1, 2, ...) and its positions restart at 0; the rest of a row is
padding (segment 0, no loss). A record longer than seq_len + 1 tokens is cut to that
(counted in the log). Every data.val_fraction-th record (spread evenly) is held out.

Batches are as jaxformer.data.batches', a pure function of (seed, step): a training
batch draws batch_size packed rows at random, evaluation reads them in order.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterator

import numpy as np

from jaxformer.data.errors import DataError
from jaxformer.data.settings import Settings, check_field_names


@dataclasses.dataclass(frozen=True)
class CompletionSettings(Settings):
    """data.format=prompt_completion: the record fields of the prompt and the completion."""

    prompt_field: str = "prompt"
    completion_field: str = "completion"

    def __post_init__(self):
        check_field_names(self)


@dataclasses.dataclass(frozen=True)
class Records:
    """Tokenised records: tokens int32 [n_tokens] (the records one after another),
    weights uint8 [n_tokens] (1: a completion token), offsets int64 [n_records + 1]."""

    tokens: np.ndarray
    weights: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def subset(self, keep: np.ndarray) -> "Records":
        idx = np.flatnonzero(keep)
        parts = [slice(self.offsets[i], self.offsets[i + 1]) for i in idx]
        lengths = np.array([p.stop - p.start for p in parts], np.int64)
        cat = (lambda a: np.concatenate([a[p] for p in parts]) if parts else a[:0])
        return Records(cat(self.tokens), cat(self.weights),
                       np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def read_records(path: str, fields: CompletionSettings) -> Iterator[tuple[str, str, str]]:
    """(record name, prompt, completion) of each JSONL line or Parquet row; a missing or
    non-text field, or an empty completion, is a DataError naming the record."""
    for name, (prompt, completion) in read_fields(path, dict(fields.by_key())):
        if not completion:
            raise DataError(f"{name}: the completion is empty, so the record has nothing to "
                            "learn; remove it or give it a completion")
        yield name, prompt, completion


def read_fields(path: str, fields: dict[str, str]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(record name, its text fields' values) of each JSONL line or Parquet row; fields:
    data config key -> the field it names (e.g. {"prompt_field": "prompt"}). A missing or
    non-text field is a DataError naming the record, the field and the keys that set it."""
    names = list(fields.values())
    keys = " / ".join(f"data.{k}" for k in fields)
    wanted = ", ".join(repr(f) for f in names)
    rows = _parquet_rows(path, names, keys) if path.endswith(".parquet") else _jsonl_rows(path)
    for name, row in rows:
        values = []
        for field in names:
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                found = "missing" if value is None else f"{type(value).__name__}, not text"
                raise DataError(f"{name}: field {field!r} is {found}; each record needs the "
                                f"text fields {wanted} (set {keys})")
            values.append(value)
        yield name, tuple(values)


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{i}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i} is not JSON ({e.msg}); each line must be one "
                                "JSON object") from None


def _parquet_rows(path: str, fields, keys: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet needs pyarrow: pip install 'jaxformer[data]'") from None
    f = pq.ParquetFile(path)
    missing = [c for c in fields if c not in f.schema_arrow.names]
    if missing:
        raise DataError(f"{path} has no column {missing[0]!r} (columns: "
                        f"{', '.join(f.schema_arrow.names)}); set {keys}")
    i = 0
    for batch in f.iter_batches(batch_size=1024, columns=list(fields)):
        for row in batch.to_pylist():
            yield f"{path}:row {i}", row
            i += 1


def tokenize(records, tokenizer) -> Records:
    """records: (name, prompt, completion) triples."""
    tokens, weights, lengths = [], [], []
    end = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    for _, prompt, completion in records:
        p = np.asarray(tokenizer.encode(prompt), np.int64)
        c = np.concatenate([np.asarray(tokenizer.encode(completion), np.int64), end])
        tokens += [p, c]
        weights += [np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]
        lengths.append(len(p) + len(c))
    if not lengths:
        return Records(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64))
    return Records(np.concatenate(tokens).astype(np.int32), np.concatenate(weights),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def pack(records: Records, seq_len: int, group: int = 1) -> tuple[np.ndarray, int]:
    """Row boundaries: int64 [n_rows + 1] record indices (row r holds records
    bounds[r] .. bounds[r + 1] - 1, in order), and how many records were cut. Records go
    in groups of `group` (a preference pair: 2) that always share a row, each cut to
    seq_len // group inputs (seq_len + 1 tokens for a record alone)."""
    cap = seq_len // group
    slots = np.minimum(np.diff(records.offsets) - 1, cap)  # inputs each record fills
    slots = slots.reshape(-1, group).sum(1)                 # and each group
    bounds, used = [0], 0
    for i, n in enumerate(slots):
        if used + n > seq_len:
            bounds.append(i * group)
            used = 0
        used += n
    if len(records):
        bounds.append(len(records))
    cut = int(np.sum(np.diff(records.offsets) - 1 > cap))
    return np.asarray(bounds, np.int64), cut


def kept_weights(records: Records, seq_len: int, group: int = 1) -> int:
    """How many weighted targets (completion tokens) survive the cut to seq_len // group
    inputs per record, as rows_batch cuts them."""
    starts, lengths = records.offsets[:-1], np.diff(records.offsets)
    n = np.minimum(lengths - 1, seq_len // group)
    total = np.concatenate([[0], np.cumsum(records.weights, dtype=np.int64)])
    return int(np.sum(total[starts + n + 1] - total[starts + 1]))


def rows_batch(records: Records, bounds: np.ndarray, rows: np.ndarray,
               seq_len: int, group: int = 1) -> dict[str, np.ndarray]:
    """The batch of packed rows `rows` (see the module docstring for its arrays; each
    record cut to seq_len // group inputs, as pack cuts them)."""
    b = len(rows)
    out = {k: np.zeros((b, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids",
                                                          "positions")}
    out["loss_mask"] = np.zeros((b, seq_len), np.float32)
    for r, row in enumerate(rows):
        at = 0
        for seg, i in enumerate(range(bounds[row], bounds[row + 1]), 1):
            s = records.offsets[i]
            n = int(min(records.offsets[i + 1] - s - 1, seq_len // group))
            ids = records.tokens[s:s + n + 1]
            out["inputs"][r, at:at + n] = ids[:-1]
            out["targets"][r, at:at + n] = ids[1:]
            out["loss_mask"][r, at:at + n] = records.weights[s + 1:s + n + 1]
            out["segment_ids"][r, at:at + n] = seg
            out["positions"][r, at:at + n] = np.arange(n)
            at += n
    return out


@dataclasses.dataclass
class CompletionData:
    """The train and val records of a prompt/completion file, packed per seq_len on first
    use; answers the loop's batch calls as jaxformer.data.Dataset does."""

    train: Records
    val: Records
    tokenizer: object
    source: str
    log: object = print
    group: int = 1  # records that share a row, one after another (a preference pair: 2)
    _bounds: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def token_counts(self) -> tuple[int, int]:
        return len(self.train.tokens), len(self.val.tokens)

    @property
    def max_id(self) -> int:
        """The largest token id of both splits (0 when empty)."""
        return int(max(self.train.tokens.max(initial=0), self.val.tokens.max(initial=0)))

    def packed(self, split: str, seq_len: int) -> np.ndarray:
        """The row bounds of a split packed into rows of seq_len (computed once)."""
        if (split, seq_len) not in self._bounds:
            records = getattr(self, split)
            bounds, cut = pack(records, seq_len, self.group)
            most = f"{'seq_len + 1' if self.group == 1 else 'seq_len // 2 + 1'} = " \
                f"{seq_len // self.group + 1}"
            if cut:
                self.log(f"data: {cut} of {len(records):,} {split} sequences are longer than "
                         f"{most} tokens and are cut to it")
            if len(records) and not kept_weights(records, seq_len, self.group):
                answer = "completion" if self.group == 1 else "answer"
                raise DataError(f"{self.source}: every {split} {answer} is cut off: its prompt "
                                f"fills {most} tokens; raise train.seq_len or shorten the "
                                "prompts")
            self._bounds[split, seq_len] = bounds
        return self._bounds[split, seq_len]

    def train_batch(self, *, seed: int, step: int, batch_size: int, seq_len: int,
                    pack: bool = True, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        bounds = self.packed("train", seq_len)
        if len(bounds) < 2:
            raise DataError(f"{self.source}: no training records")
        rng = np.random.default_rng([seed, step])
        picked = rng.integers(0, len(bounds) - 1, size=batch_size)
        return rows_batch(self.train, bounds, picked[rows], seq_len, self.group)

    def eval_batches(self, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                     pack: bool = True, rows: slice = slice(None)):
        bounds = self.packed("val", seq_len)
        n = (len(bounds) - 1) // batch_size
        if n == 0:
            raise DataError(f"{self.source}: the val split packs into {len(bounds) - 1} rows of "
                            f"seq_len={seq_len}, fewer than batch_size={batch_size}; raise "
                            "data.val_fraction or lower train.batch_size")
        n = n if max_batches is None else min(n, max_batches)
        return (rows_batch(self.val, bounds, (b * batch_size + np.arange(batch_size))[rows],
                           seq_len, self.group) for b in range(n))


def load_completions(cfg, tokenizer, vocab_size=None, log=print) -> CompletionData:
    """The prompt/completion file cfg.path (cfg: a DataConfig), tokenised and split."""
    fields = cfg.format_settings
    records = tokenize(read_records(cfg.path, fields), tokenizer)
    if not records.weights.any():
        raise DataError(f"{cfg.path} holds no completion tokens; each record needs a non-empty "
                        f"{fields.completion_field!r}")
    i = np.arange(len(records))
    val = np.floor((i + 1) * cfg.val_fraction) > np.floor(i * cfg.val_fraction)
    return CompletionData(records.subset(~val), records.subset(val), tokenizer,
                          f"prompt/completion records {cfg.path} ({len(records):,}: "
                          f"{int((~val).sum()):,} train, {int(val.sum()):,} val)", log)
