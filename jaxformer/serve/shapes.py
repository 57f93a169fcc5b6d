"""The shapes of the engine's programs (jaxformer.serve.engine): each distinct shape is a
compiled program, so the engine rounds what a step needs up to a few sizes.

A forward's page-table width and a decode step's rows are powers of two (table_width), at
least LEAST_KEYS / page_size pages and LEAST_ROWS rows; a prompt chunk is a power of two
from LEAST_CHUNK up to prefill_chunk wide, over at most PREFILL_ROWS prompts. A decode
step that reads each row's own pages runs (row, page) pairs (pairs_of) in counts of 2^k or
3 x 2^(k-1) (pair_count): at most a third more than needed, not twice.
"""

from __future__ import annotations

import numpy as np

PREFILL_ROWS = 4  # prompts whose next chunk runs in one step (fewer slots: as many)
# a forward reads at least this many keys per row, a decode step runs at least this many
# rows, a prompt chunk is at least this wide: below them, masked keys and padding cost less
# than compiling another program
LEAST_KEYS, LEAST_ROWS, LEAST_CHUNK = 32, 8, 32
# the least page size whose decode steps read (row, page) pairs (bench/grpo_rollout.py's
# pages of 1: a rollout 1.7x slower by pairs; bench/engine_step.py's of 16: steps 1.2x faster)
PAIR_PAGES = 8


def table_width(pages: int, longest: int, least: int = 1) -> int:
    """The page-table width a forward runs: the power of two >= the pages its longest row
    holds (and >= `least`), at most `longest` (a sequence's most pages); as well the rows
    a decode step runs (pages: its rows, longest: the slots)."""
    return min(longest, max(least, 1 << max(pages - 1, 0).bit_length()))


def pair_count(pairs: int, most: int, least: int) -> int:
    """The pairs a decode step runs: the least of 2^k and 3 * 2^(k-1) >= `pairs` (and >=
    `least`), at most `most`: at most a third more than needed, not twice."""
    size = table_width(pairs, most, least)
    smaller = size * 3 // 4
    return smaller if size > 2 and smaller >= max(pairs, least) else size


def pairs_of(table, held, dropped, rows: int, most: int, least: int, none: int) -> tuple:
    """A decode step's (row, page, index) pairs (jaxformer.attention.paged_cache): row i's
    pages dropped[i] .. held[i] - 1 of table [R, M] (logical indices: its pages before
    dropped[i] are released), in row order, padded (row `rows`, page `none`, index 0) to
    pair_count(pairs, rows * most, rows * least) pairs."""
    live = np.subtract(held, dropped)
    n = int(live.sum())
    size = pair_count(n, rows * most, rows * least)
    row, index = np.full(size, rows, np.int32), np.zeros(size, np.int32)
    row[:n] = np.repeat(np.arange(len(held)), live)
    index[:n] = np.arange(n) - np.repeat(np.cumsum(live) - live, live) + np.repeat(dropped, live)
    page = np.full(size, none, np.int32)
    page[:n] = table[row[:n], index[:n]]
    return row, page, index
