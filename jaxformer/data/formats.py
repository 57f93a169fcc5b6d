"""The formats data.format chooses, one entry each in FORMATS: its settings (the record
fields it reads, each a data key), how it reads its data, and what its batches hold.

A corpus format (text) is tokenised into the cache by load_dataset
(jaxformer.data.dataset); a format of records reads data.path's .jsonl or .parquet
records with its own `load`. Other code asks the entry, never the name: ``records``
(records or a corpus), ``batch`` (what a batch holds; an objective or model says which
it trains on)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from jaxformer.core.validation import ConfigError
from jaxformer.data.completions import CompletionSettings, load_completions
from jaxformer.data.preferences import PreferenceSettings, load_preferences
from jaxformer.data.seq2seq import Seq2SeqSettings, load_pairs
from jaxformer.data.seq2seq_tasks import SEQ2SEQ_TASKS
from jaxformer.data.settings import Settings

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")

# What a format's batches hold (Format.batch), the words objectives and models ask for:
BATCHES = {
    "tokens": "windows of a token stream, the loss on every token",
    "completions": "records packed one per segment, the loss on the completions "
                   "(jaxformer.data.completions)",
    "pairs": "preference pairs, a prompt's chosen and rejected answers as segments 2k - 1 "
             "and 2k of a row (jaxformer.data.preferences)",
    "sources": "(source, target) pairs for an encoder-decoder (jaxformer.data.seq2seq)",
}


@dataclasses.dataclass(frozen=True)
class TextSettings(Settings):
    """data.format=text: text_field, the JSONL field or Parquet column of a corpus's text."""

    text_field: str = "text"

    def __post_init__(self):
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"data.text_field={self.text_field!r} must be a non-empty string")


@dataclasses.dataclass(frozen=True)
class Format:
    """One data format.

    settings: its frozen settings class (jaxformer.data.settings): its fields are data
      keys, checked by it; a key of another format must keep its default.
    batch: what its batches hold, a key of BATCHES.
    load(cfg, tokenizer, vocab_size, log) -> its data (train_batch, eval_batches,
      token_counts, max_id) from the records of cfg.path; None: a text corpus, which
      load_dataset tokenises into the cache.
    tasks: names that data.path may give in place of a file: generated tasks, whose
      records carry the settings' default fields (jaxformer.data.seq2seq_tasks).
    """

    settings: type
    batch: str
    load: Callable | None = None
    tasks: Mapping[str, Callable] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.batch not in BATCHES:
            raise ValueError(f"Format.batch={self.batch!r} is not one of {', '.join(BATCHES)}")

    @property
    def records(self) -> bool:
        """It reads a file of records (not a corpus of text or token ids)."""
        return self.load is not None


FORMATS: dict[str, Format] = {
    "text": Format(TextSettings, batch="tokens"),
    "prompt_completion": Format(CompletionSettings, batch="completions", load=load_completions),
    "preference": Format(PreferenceSettings, batch="pairs", load=load_preferences),
    "seq2seq": Format(Seq2SeqSettings, batch="sources", load=load_pairs,
                      tasks=SEQ2SEQ_TASKS),
}
