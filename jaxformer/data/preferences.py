"""Preference pairs (data.format=preference): a prompt with a chosen and a rejected answer.

Each JSONL line (or Parquet row) holds the text fields data.prompt_field,
data.chosen_field and data.rejected_field. A pair becomes two records of
jaxformer.data.completions, prompt + chosen and prompt + rejected (each + the
tokenizer's end-of-text id when it has one), packed as that module packs records, the
two always in the same row one after the other: in a row, segment 2k - 1 is pair k's
chosen answer and segment 2k its rejected one (segment 0: padding). loss_mask marks the
answers' tokens, so summing a token's log-probability times loss_mask over a segment
gives the answer's log-probability given the prompt (jaxformer.training.objectives).
Each answer is cut to seq_len // 2 inputs (counted in the log). Every
data.val_fraction-th pair (spread evenly) is held out.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxformer.data.completions import CompletionData, read_fields, tokenize
from jaxformer.data.errors import DataError
from jaxformer.data.settings import Settings, check_field_names

CHOSEN, REJECTED = 1, 2  # a pair's segments in a row are 2k - 1 (chosen) and 2k (rejected)


@dataclasses.dataclass(frozen=True)
class PreferenceSettings(Settings):
    """data.format=preference: the record fields of the prompt and of the two answers."""

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"

    def __post_init__(self):
        check_field_names(self)


def read_pairs(path: str, fields: PreferenceSettings):
    """(record name, prompt, answer) twice per pair, the chosen answer first; an empty
    answer is a DataError naming the record."""
    for name, (prompt, chosen, rejected) in read_fields(path, dict(fields.by_key())):
        for field, answer in ((fields.chosen_field, chosen), (fields.rejected_field, rejected)):
            if not answer:
                raise DataError(f"{name}: field {field!r} is empty; a pair needs two "
                                "non-empty answers to compare")
        yield name, prompt, chosen
        yield name, prompt, rejected


def load_preferences(cfg, tokenizer, vocab_size=None, log=print) -> CompletionData:
    """The preference file cfg.path (cfg: a DataConfig), tokenised, split by pair and
    packed in pairs."""
    fields = cfg.format_settings
    records = tokenize(read_pairs(cfg.path, fields), tokenizer)
    pairs = len(records) // 2
    if not pairs:
        raise DataError(f"{cfg.path} holds no preference pairs; each line needs the fields "
                        f"{fields.prompt_field!r}, {fields.chosen_field!r} and "
                        f"{fields.rejected_field!r}")
    i = np.arange(pairs)
    val = np.floor((i + 1) * cfg.val_fraction) > np.floor(i * cfg.val_fraction)
    val2 = np.repeat(val, 2)  # both records of a pair on the same side
    return CompletionData(records.subset(~val2), records.subset(val2), tokenizer,
                          f"preference pairs {cfg.path} ({pairs:,}: {int((~val).sum()):,} "
                          f"train, {int(val.sum()):,} val)", log, group=2)
