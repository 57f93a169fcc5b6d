"""DataConfig: where the training text comes from and how it becomes token ids."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxformer.core.validation import ConfigError, Section, check_choice, check_number
from jaxformer.data.seq2seq_tasks import SEQ2SEQ_TASKS

TOKENIZERS = ("bytes", "bpe")
BIN_DTYPES = ("uint16", "uint32")
FORMATS = ("text", "prompt_completion", "preference", "seq2seq")
RECORDS = ("prompt_completion", "preference", "seq2seq")  # the formats of records, not a corpus


def parse_mixture(spec) -> tuple[tuple[str, str, float], ...]:
    """'PATH:WEIGHT,...' (or a list of 'PATH:WEIGHT' / {path, weight} entries) -> ((name,
    path, weight), ...), each name the path's stem; one-line errors for the rest."""
    entries = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for entry in entries:
        if isinstance(entry, dict) and set(entry) == {"path", "weight"}:
            path, weight = str(entry["path"]), entry["weight"]
        elif isinstance(entry, str) and ":" in entry:
            path, weight = entry.strip().rsplit(":", 1)
        else:
            raise ConfigError(f"data.mixture entry {entry!r} is not PATH:WEIGHT (e.g. "
                              "data.mixture=code.txt:0.8,prose.jsonl:0.2)")
        try:
            weight = float(weight)
        except ValueError:
            raise ConfigError(f"data.mixture entry {entry!r}: the weight {weight!r} is not a "
                              "number") from None
        if not weight > 0 or not np.isfinite(weight):
            raise ConfigError(f"data.mixture entry {entry!r}: the weight must be > 0")
        name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
        out.append((name, path, weight))
    names = [n for n, _, _ in out]
    if len(out) < 2 or len(set(names)) < len(names):
        raise ConfigError(f"data.mixture needs two or more sources with different file names "
                          f"(each names its val_loss/NAME); got {', '.join(names)}")
    return tuple(out)


class DataError(ValueError):
    """The data cannot be used as configured; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """Every choice of the data pipeline.

    path: None = the default corpus (the Python standard library's own .py source);
      a text file; a folder of .txt/.md/.py files (recursive); a .jsonl file (one JSON
      object per line, text in ``text_field``); a .parquet file or a folder of them
      (text in the column ``text_field``; needs pyarrow: jaxformer[data]); a
      nanoGPT-style .bin file of token ids; or a folder holding train.bin and val.bin.
      A file that is not text is refused.
    tokenizer: "bytes" (vocab 256, no separator token) | "bpe" (byte-level BPE trained on
      the train split, saved into the run dir) | a path to a tokenizer.json (or to a
      folder holding one).
    bpe_vocab_size: vocabulary size for tokenizer="bpe" (>= 257: 256 bytes + <|endoftext|>).
    bpe_train_bytes: how much of the train split BPE is trained on, about: a sample
      spread over all of it (100 MB: ~20 s and ~0.6 GB on 2 cores).
    val_fraction: fraction of the documents (files, JSONL records, Parquet rows) held out for
      validation; of the tokens for a single text file or a single .bin file.
    text_field: the JSONL field or Parquet column that holds the text.
    bin_dtype: the dtype of .bin token files: uint16 | uint32.
    pack: batches carry segment_ids and positions that restart at document boundaries.
    cache_dir: where tokenized corpora are cached; None = ~/.cache/jaxformer.
    format: text (a corpus, as above) | prompt_completion (a .jsonl or .parquet file of
      records with the fields prompt_field and completion_field, packed one record per
      segment with the loss on the completion alone: jaxformer.data.completions) |
      preference (records with prompt_field, chosen_field and rejected_field, each pair
      packed as two segments side by side, for objective.name=dpo:
      jaxformer.data.preferences) | seq2seq (records with source_field and target_field,
      packed on both sides, for model.arch=encoder_decoder: jaxformer.data.seq2seq; or
      data.path a generated task of jaxformer.data.seq2seq_tasks, e.g. number_words).
    mixture: PATH:WEIGHT,PATH:WEIGHT,... (or a YAML list of them) in place of path: each
      row of a batch from a source drawn with those weights (jaxformer.data.mixture).
    """

    path: str | None = None
    tokenizer: str = "bytes"
    bpe_vocab_size: int = 4096
    bpe_train_bytes: int = 100_000_000
    val_fraction: float = 0.05
    text_field: str = "text"
    bin_dtype: str = "uint16"
    pack: bool = False
    cache_dir: str | None = None
    format: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    source_field: str = "source"
    target_field: str = "target"
    mixture: str | None = None

    def __post_init__(self):
        o = "data"
        self._check_mixture()
        for name in ("path", "cache_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"data.{name}={value!r} must be a non-empty path or None")
        if isinstance(self.tokenizer, os.PathLike):
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        if not isinstance(self.tokenizer, str) or not (
                self.tokenizer in TOKENIZERS or self.tokenizer.endswith(".json")
                or os.path.isdir(self.tokenizer)):
            raise ConfigError(f"data.tokenizer={self.tokenizer!r} is not one of "
                              f"{', '.join(TOKENIZERS)}, a path to a tokenizer.json, "
                              "or a folder holding one")
        check_number(o, "bpe_vocab_size", self.bpe_vocab_size, int, low=257, high=2**32)
        check_number(o, "bpe_train_bytes", self.bpe_train_bytes, int, low=1)
        check_number(o, "val_fraction", self.val_fraction, float, low=0, high=1, high_open=True)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"data.text_field={self.text_field!r} must be a non-empty string")
        check_choice(o, "bin_dtype", self.bin_dtype, BIN_DTYPES)
        check_choice(o, "format", self.format, FORMATS)
        for name in ("prompt_field", "completion_field", "chosen_field", "rejected_field",
                     "source_field", "target_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"data.{name}={getattr(self, name)!r} must be a field name")
        if self.format in RECORDS and not str(self.path).endswith(
                (".jsonl", ".json", ".parquet")) and not (
                self.format == "seq2seq" and self.path in SEQ2SEQ_TASKS):
            raise ConfigError(f"data.format={self.format} reads a .jsonl or .parquet file "
                              f"of records, not data.path={self.path!r}")
        if self.format in RECORDS and self.tokenizer == "bpe":
            raise ConfigError(f"data.format={self.format} needs a tokenizer it does not "
                              "train: data.tokenizer=bytes or a tokenizer.json (e.g. the one "
                              "of the model it fine-tunes, the default with train.init_from)")
        if not isinstance(self.pack, bool):
            raise ConfigError(f"data.pack={self.pack!r} must be true or false")

    def _check_mixture(self):
        """data.mixture held as 'PATH:WEIGHT,...' (a list is joined), checked in one line."""
        if self.mixture is None:
            return
        sources = parse_mixture(self.mixture)
        object.__setattr__(self, "mixture", ",".join(f"{p}:{w!r}" for _, p, w in sources))
        for name, bad, fix in (("path", self.path is not None, "unset data.path"),
                               ("format", self.format != "text", "data.format=text"),
                               ("tokenizer", self.tokenizer == "bpe",
                                "a tokenizer.json (e.g. from python -m jaxformer.data.prepare "
                                "on one source) or bytes")):
            if bad:
                raise ConfigError(f"data.mixture reads text corpora with one given tokenizer, "
                                  f"not data.{name}={getattr(self, name)!r}; use {fix}")

    SECTION = "data"  # from_dict, to_dict, replace: jaxformer.core.validation.Section
