"""Synthetic sequence tasks for length generalisation, generated in memory with NumPy, and
the packing of their examples into rows the model trains and is scored on.

An example is one token sequence: a task marker, the input, ``=``, the answer, end of
sequence. Its *length* is the number of input symbols (digits per operand for addition):

    copy      C x1 .. xn = x1 .. xn E
    reverse   R x1 .. xn = xn .. x1 E
    addition  A a1 .. an + b1 .. bn = s1 .. s(n+1) E

Addition writes every number least significant digit first (operands and sum), as in the
length-generalisation literature (Kazemnejad et al. 2023; Zhou et al. 2024), so each sum
digit depends on the operand digits at its own place and the carry from the place before.
Operands are n uniform digits (leading zeros allowed), the sum has n + 1 (its last digit
the final carry, 0 or 1), so an example's layout depends on n alone.

The answer is everything after ``=``, the end-of-sequence token included: greedy decoding
of the prompt (up to ``=``) has solved an example when it reproduces the answer exactly.

Position ids (study.task_positions; example_positions):
- index: 0, 1, 2, ... along the example;
- coupled (Cho et al. 2024, position coupling): digits of equal significance share an
  id across operands and answer, start + 1 + i for the i-th least significant; ``+`` and
  ``=`` take start, the marker and end 0. For copy the i-th answer digit is coupled to
  the i-th input digit, for reverse to the one it copies. start = 1 + a random offset in
  training (so every id up to the largest is trained), 1 in evaluation;
- abacus (McLeish et al. 2024): each digit's place within its number, 1, 2, ... (least
  significant first), plus a random offset k in training (0 in evaluation); every other
  token 0.
"""

from __future__ import annotations

import numpy as np

PAD = 0           # never inside an example: rows are padded with it (segment id 0)
DIGIT = 1         # the token of digit d is DIGIT + d
PLUS, EQUALS, EOS = 11, 12, 13
MARKERS = {"copy": 14, "reverse": 15, "addition": 16}  # each example's first token
TASKS = tuple(MARKERS)
VOCAB_SIZE = 17


def example_tokens(task: str, length):
    """The number of tokens of one example of `task` with `length` input symbols (an int, or
    an array of them)."""
    return 3 * length + 5 if task == "addition" else 2 * length + 3


def answer_start(task: str, length):
    """The index of an example's first answer token (the one after ``=``); int or array."""
    return 2 * length + 3 if task == "addition" else length + 2


TASK_POSITIONS = ("index", "coupled", "abacus")


def example_positions(task: str, length: int, kind: str, offset: int = 0) -> np.ndarray:
    """The position ids of an example of `task` with `length` input symbols, one per token
    (example_tokens of them), as `kind` (TASK_POSITIONS) assigns them, with the training
    offset `offset` (0 in evaluation). int32."""
    n = length
    if kind == "index":
        return np.arange(example_tokens(task, n), dtype=np.int32)
    place = np.arange(1, n + 1)  # the digits' places, least significant first
    if kind == "abacus":
        run = lambda m: offset + np.arange(1, m + 1)  # noqa: E731  one number's digits
        parts = [[0], run(n), [0], run(n), [0], run(n + 1), [0]] if task == "addition" else \
            [[0], run(n), [0], run(n), [0]]
    elif kind == "coupled":
        start = 1 + offset
        answer = {"addition": np.arange(1, n + 2), "copy": place, "reverse": place[::-1]}[task]
        parts = [[0], start + place, [start], start + place, [start], start + answer, [0]] \
            if task == "addition" else [[0], start + place, [start], start + answer, [0]]
    else:
        raise ValueError(f"unknown task positions {kind!r}; choose from {', '.join(TASK_POSITIONS)}")
    return np.concatenate(parts).astype(np.int32)


def make_examples(task: str, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` random examples of `task` with `length` input symbols: int32 [count, tokens]."""
    if task not in MARKERS:
        raise ValueError(f"unknown task {task!r}; tasks are: {', '.join(TASKS)}")
    if length < 1:
        raise ValueError(f"an example needs at least one input symbol, got length {length}")
    x = rng.integers(0, 10, (count, length))  # [count, n] digits
    if task == "addition":
        y = rng.integers(0, 10, (count, length))
        body = [x, np.full((count, 1), PLUS - DIGIT), y, np.full((count, 1), EQUALS - DIGIT),
                add_reversed(x, y)]
    else:
        answer = x if task == "copy" else x[:, ::-1]
        body = [x, np.full((count, 1), EQUALS - DIGIT), answer]
    tokens = np.concatenate(body, axis=1) + DIGIT  # digits and symbols as tokens
    ends = [np.full((count, 1), MARKERS[task]), tokens, np.full((count, 1), EOS)]
    return np.concatenate(ends, axis=1).astype(np.int32)


def add_reversed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The digits of a + b, least significant first, for digit arrays [count, n] written the
    same way: [count, n + 1] (the last one the final carry)."""
    out = np.zeros((a.shape[0], a.shape[1] + 1), np.int64)
    carry = np.zeros(a.shape[0], np.int64)
    for i in range(a.shape[1]):  # place by place, the carry moving up
        total = a[:, i] + b[:, i] + carry
        out[:, i], carry = total % 10, total // 10
    out[:, -1] = carry
    return out


def sample_examples(task: str, lengths, rng: np.random.Generator) -> list[np.ndarray]:
    """One example per entry of `lengths`, in that order (examples of equal length are drawn
    together)."""
    lengths = np.asarray(lengths)
    out: list[np.ndarray | None] = [None] * len(lengths)
    for n in np.unique(lengths):
        where = np.flatnonzero(lengths == n)
        for i, ex in zip(where, make_examples(task, int(n), len(where), rng)):
            out[i] = ex
    return out


def pack(examples, answer_starts, row_len: int, rows: int | None = None,
         positions=None) -> dict:
    """Examples placed one after another into rows of `row_len` inputs, a row closed when
    the next example does not fit; padding fills the rest (token PAD, segment id 0).

    An example of m tokens fills m - 1 slots (inputs are its tokens but the last, targets
    all but the first). Returns int32 [R, row_len] inputs, targets, segment_ids (1, 2, ...
    within a row), positions (restarting at 0 at every example), example (its index in
    `examples`, -1 on padding), and float32 loss_mask: 1 exactly where the target is an
    answer token. rows: pad (with empty rows) or cut to this many rows; examples beyond
    them are left out. positions: each example's position ids (example_positions), None
    for 0, 1, 2, ...
    """
    placed = []  # (row, offset, example index)
    row, offset = 0, 0
    for i, ex in enumerate(examples):
        slots = len(ex) - 1
        if slots > row_len:
            raise ValueError(f"example {i} needs {slots} slots, more than a row of {row_len}")
        if offset + slots > row_len:
            row, offset = row + 1, 0
        placed.append((row, offset, i))
        offset += slots
    n_rows = rows if rows is not None else (row + 1 if placed else 0)
    out = {k: np.zeros((n_rows, row_len), np.int32)
           for k in ("inputs", "targets", "segment_ids", "positions")}
    out["example"] = np.full((n_rows, row_len), -1, np.int32)
    out["loss_mask"] = np.zeros((n_rows, row_len), np.float32)
    segment = 0
    for r, o, i in placed:
        if r >= n_rows:
            break
        segment = 1 if o == 0 else segment + 1
        ex, span = examples[i], slice(o, o + len(examples[i]) - 1)
        out["inputs"][r, span], out["targets"][r, span] = ex[:-1], ex[1:]
        out["segment_ids"][r, span], out["example"][r, span] = segment, i
        out["positions"][r, span] = np.arange(len(ex) - 1) if positions is None else \
            positions[i][:-1]
        out["loss_mask"][r, span] = np.arange(1, len(ex)) >= answer_starts[i]
    return out


def train_batch(task: str, max_len: int, batch_size: int, row_len: int,
                rng: np.random.Generator, positions: str = "index", max_offset: int = 0) -> dict:
    """`batch_size` full rows of examples with lengths uniform in 1..max_len (packed, without
    the example key): the model's training batch. positions: TASK_POSITIONS' kind, each
    example's offset uniform in 0..max_offset."""
    slots = example_tokens(task, 1) - 1  # the fewest slots an example takes
    lengths = rng.integers(1, max_len + 1, batch_size * (row_len // slots + 1))
    used = np.cumsum(example_tokens(task, lengths) - 1)
    lengths = lengths[:np.searchsorted(used, batch_size * row_len) + 1]  # enough to fill
    examples = sample_examples(task, lengths, rng)
    offsets = rng.integers(0, max_offset + 1, len(lengths))
    ids = [example_positions(task, int(n), positions, int(k)) for n, k in zip(lengths, offsets)]
    batch = pack(examples, answer_start(task, lengths), row_len, rows=batch_size, positions=ids)
    del batch["example"]
    return batch
