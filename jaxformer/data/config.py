"""DataConfig: where the training text comes from and how it becomes token ids."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxformer.core.validation import ConfigError, Section, check_choice, check_number
from jaxformer.data.errors import DataError  # noqa: F401 (its home before errors.py)
from jaxformer.data.formats import FORMATS, RECORD_SUFFIXES, Format
from jaxformer.data.settings import Settings, check_foreign
from jaxformer.data.tokenizer_kinds import TOKENIZERS, TokenizerKind, tokenizer_kind

BIN_DTYPES = ("uint16", "uint32")


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
            raise ConfigError(f"data.mixture entry {entry!r}: the weight must be a finite "
                              "number > 0")
        name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
        out.append((name, path, weight))
    names = [n for n, _, _ in out]
    if len(out) < 2 or len(set(names)) < len(names):
        raise ConfigError(f"data.mixture needs two or more sources with different file names "
                          f"(each names its val_loss/NAME); got {', '.join(names)}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """Every choice of the data pipeline.

    The entries of two tables own their settings, which are keys of this section too
    (one flat section, as YAML files write it): data.tokenizer chooses a kind of
    jaxformer.data.tokenizer_kinds.TOKENIZERS, data.format a format of
    jaxformer.data.formats.FORMATS. Each entry's settings class checks its keys; a key of
    another format than data.format must keep its default (a saved config.yaml names
    every key), while bpe_* may stay set when a config's tokenizer is overridden.

    path: None = the default corpus (the Python standard library's own .py source);
      a text file; a folder of .txt/.md/.py files (recursive); a .jsonl file (one JSON
      object per line, text in ``text_field``); a .parquet file or a folder of them
      (text in the column ``text_field``; needs pyarrow: jaxformer[data]); a
      nanoGPT-style .bin file of token ids; or a folder holding train.bin and val.bin.
      A file that is not text is refused.
    tokenizer: "bytes" (vocab 256, no separator token) | "bpe" (byte-level BPE trained on
      the train split, saved into the run dir) | a path to a tokenizer.json (or to a
      folder holding one).
    bpe_vocab_size, bpe_train_bytes: bpe's settings (tokenizer_kinds.BpeSettings): its
      vocabulary size (>= 257: 256 bytes + <|endoftext|>), and about how much of the
      train split it is trained on, a sample spread over all of it (100 MB: ~20 s and
      ~0.6 GB on 2 cores).
    val_fraction: fraction of the documents (files, JSONL records, Parquet rows) held out for
      validation; of the tokens for a single text file or a single .bin file.
    text_field: text's setting: the JSONL field or Parquet column that holds the text.
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
        for name in ("path", "cache_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"data.{name}={value!r} must be a non-empty path or None")
        if isinstance(self.tokenizer, os.PathLike):
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        tokenizer_kind(self.tokenizer)
        for kind in TOKENIZERS.values():  # a preset's bpe_* stay when the kind is overridden
            kind.settings.of(self)
        check_number(o, "val_fraction", self.val_fraction, float, low=0, high=1, high_open=True)
        check_choice(o, "bin_dtype", self.bin_dtype, BIN_DTYPES)
        check_choice(o, "format", self.format, FORMATS)
        check_foreign(self, FORMATS, self.format, "format")
        self.format_entry.settings.of(self)  # its class checks its keys
        self._check_mixture()
        self._check_records()
        if not isinstance(self.pack, bool):
            raise ConfigError(f"data.pack={self.pack!r} must be true or false")

    @property
    def format_entry(self) -> Format:
        """data.format's entry of jaxformer.data.formats.FORMATS."""
        return FORMATS[self.format]

    @property
    def format_settings(self) -> Settings:
        """data.format's settings (its keys' values)."""
        return self.format_entry.settings.of(self)

    @property
    def tokenizer_entry(self) -> TokenizerKind:
        """data.tokenizer's entry of jaxformer.data.tokenizer_kinds.TOKENIZERS."""
        return TOKENIZERS[tokenizer_kind(self.tokenizer)]

    @property
    def tokenizer_settings(self) -> Settings:
        """data.tokenizer's settings (its keys' values)."""
        return self.tokenizer_entry.settings.of(self)

    def _check_records(self):
        """A format of records reads a file of them (or a generated task), with a
        tokenizer it does not train."""
        fmt = self.format_entry
        if fmt.records and not str(self.path).endswith(RECORD_SUFFIXES) and \
                self.path not in fmt.tasks:
            raise ConfigError(f"data.format={self.format} reads a .jsonl or .parquet file "
                              f"of records, not data.path={self.path!r}")
        if fmt.records and self.tokenizer_entry.trains:
            raise ConfigError(f"data.format={self.format} needs a tokenizer it does not "
                              "train: data.tokenizer=bytes or a tokenizer.json (e.g. the one "
                              "of the model it fine-tunes, the default with train.init_from)")

    def _check_mixture(self):
        """data.mixture held as 'PATH:WEIGHT,...' (a list is joined), checked in one line."""
        if self.mixture is None:
            return
        sources = parse_mixture(self.mixture)
        object.__setattr__(self, "mixture", ",".join(f"{p}:{w!r}" for _, p, w in sources))
        corpora = "|".join(n for n, f in FORMATS.items() if not f.records)
        for name, bad, fix in (("path", self.path is not None, "unset data.path"),
                               ("format", self.format_entry.records, f"data.format={corpora}"),
                               ("tokenizer", self.tokenizer_entry.trains,
                                "a tokenizer.json (e.g. from python -m jaxformer.data.prepare "
                                "on one source) or bytes")):
            if bad:
                raise ConfigError(f"data.mixture reads text corpora with one given tokenizer, "
                                  f"not data.{name}={getattr(self, name)!r}; use {fix}")

    SECTION = "data"  # from_dict, to_dict, replace: jaxformer.core.validation.Section
