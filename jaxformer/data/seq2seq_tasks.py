"""Translation-like (source, target) tasks generated offline, deterministically, for
data.format=seq2seq: data.path names one (a key of SEQ2SEQ_TASKS) in place of a file.

number_words: the numbers 0 .. 9999 written in a made-up language of words (each nonzero
digit's word, followed by its place's word: 3045 -> "tri kil kav tal pen", 0 -> "nul"),
translated to their digits in a made-up alphabet (0 -> q, 1 -> w, ...: 3045 -> "rqty"),
in an order shuffled by a fixed seed. task_file writes a task once as a JSONL file of
{"source", "target"} records in the data cache, which data.format=seq2seq then reads. Reading it needs what translation needs: words to
symbols, a reordering (zeros the source leaves unsaid), lengths that differ.
"""

from __future__ import annotations

import json
import os

import numpy as np

DIGIT_WORDS = ("nul", "ein", "dva", "tri", "kav", "pen", "hex", "sep", "okt", "nov")
PLACE_WORDS = ("", "tal", "hun", "kil")  # units, tens, hundreds, thousands
DIGIT_SYMBOLS = "qwertyuiop"


def number_words(n: int) -> str:
    """n in 0 .. 9999 in the made-up words."""
    if n == 0:
        return DIGIT_WORDS[0]
    words = []
    for place in range(3, -1, -1):
        d = n // 10 ** place % 10
        if d:
            words += [DIGIT_WORDS[d]] + ([PLACE_WORDS[place]] if place else [])
    return " ".join(words)


def number_symbols(n: int) -> str:
    """n's digits in the made-up alphabet."""
    return "".join(DIGIT_SYMBOLS[int(c)] for c in str(n))


def number_word_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """Every (words, symbols) pair of 0 .. 9999, in a fixed shuffled order."""
    order = np.random.default_rng(seed).permutation(10_000)
    return [(number_words(int(n)), number_symbols(int(n))) for n in order]


SEQ2SEQ_TASKS = {"number_words": number_word_pairs}


def task_file(name: str, cache_dir: str) -> str:
    """The JSONL file of generated task `name` in cache_dir (written once, atomically)."""
    path = os.path.join(cache_dir, "seq2seq_tasks", f"{name}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for source, target in SEQ2SEQ_TASKS[name]():
                f.write(json.dumps({"source": source, "target": target}) + "\n")
        os.replace(tmp, path)
    return path
