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

import numpy as np

from jaxformer.data.completions import CompletionData, read_fields, tokenize
from jaxformer.data.config import DataConfig, DataError

CHOSEN, REJECTED = 1, 2  # a pair's segments in a row are 2k - 1 (chosen) and 2k (rejected)


def read_pairs(cfg: DataConfig):
    """(record name, prompt, answer) twice per pair, the chosen answer first; an empty
    answer is a DataError naming the record."""
    fields = {"prompt_field": cfg.prompt_field, "chosen_field": cfg.chosen_field,
              "rejected_field": cfg.rejected_field}
    for name, (prompt, chosen, rejected) in read_fields(cfg.path, fields):
        for field, answer in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
            if not answer:
                raise DataError(f"{name}: field {field!r} is empty; a pair needs two "
                                "non-empty answers to compare")
        yield name, prompt, chosen
        yield name, prompt, rejected


def load_preferences(cfg: DataConfig, tokenizer, log=print) -> CompletionData:
    """The preference file cfg.path, tokenised, split by pair and packed in pairs."""
    records = tokenize(read_pairs(cfg), tokenizer)
    pairs = len(records) // 2
    if not pairs:
        raise DataError(f"{cfg.path} holds no preference pairs; each line needs the fields "
                        f"{cfg.prompt_field!r}, {cfg.chosen_field!r} and {cfg.rejected_field!r}")
    i = np.arange(pairs)
    val = np.floor((i + 1) * cfg.val_fraction) > np.floor(i * cfg.val_fraction)
    val2 = np.repeat(val, 2)  # both records of a pair on the same side
    return CompletionData(records.subset(~val2), records.subset(val2), tokenizer,
                          f"preference pairs {cfg.path} ({pairs:,}: {int((~val).sum()):,} "
                          f"train, {int(val.sum()):,} val)", log, group=2)
