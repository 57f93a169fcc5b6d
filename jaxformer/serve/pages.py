"""The host side of the paged KV cache: which page holds what. A pool of `pages` pages of
`page_size` tokens each; a free list; a reference count per page (the sequences that
hold it); and a prefix cache: a full page of a sequence's tokens is known by the hash
chain of its tokens and every token before it (chain_hashes), so a later sequence that
starts with the same tokens holds the same page instead of computing it again (a prefix
shared by many sequences is held once).

A page no sequence holds any more goes back to the free list, or, if the prefix cache
knows it, waits among the cached pages (least recently released first) until a sequence
holds it again or the pool runs short and takes it back (evicted: forgotten, reused).
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np


def chain_hashes(tokens: Sequence[int], page_size: int, start: int = 0,
                 previous: int | None = None) -> list[int]:
    """The hash chain of the full pages of `tokens` from page `start` on: page i's is the
    hash of (page i - 1's, its tokens); `previous`: page start - 1's (None before page 0)."""
    out = []
    for i in range(start, len(tokens) // page_size):
        previous = hash((previous, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(previous)
    return out


class PagePool:
    """The pages' bookkeeping (no arrays of keys: those live on the device, in
    jaxformer.attention.paged_cache's layout, at the ids handed out here)."""

    def __init__(self, pages: int, page_size: int):
        self.pages, self.page_size = pages, page_size
        self.free = list(range(pages - 1, -1, -1))  # popped from the end: low ids first
        self.refs = np.zeros(pages, np.int64)
        self.known: dict[int, int] = {}  # chain hash -> the page holding those tokens
        self.hash_of: dict[int, int] = {}  # page -> its chain hash (pages known)
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # known, unheld

    @property
    def available(self) -> int:
        """Pages that can be handed out now: free, or cached and held by no one."""
        return len(self.free) + len(self.idle)

    def take(self, n: int) -> list[int] | None:
        """n pages, each held once (from the free list, then evicting the least recently
        released cached pages), or None (nothing taken) when fewer are available."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.known[self.hash_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def hold(self, page: int) -> None:
        """One more sequence holds `page` (a cached one leaves the idle list)."""
        self.refs[page] += 1
        self.idle.pop(page, None)

    def release(self, pages: Sequence[int]) -> None:
        """Each of `pages` is held once less; one held by no one is freed, or kept as a
        cached page (the most recently released) if the prefix cache knows it."""
        for page in pages:
            if self.refs[page] <= 0:
                raise ValueError(f"page {page} released more often than held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the longest prefix of a chain of page hashes, each now held
        once more by the caller."""
        found = []
        for h in hashes:
            if h not in self.known:
                break
            found.append(self.known[h])
        for page in found:
            self.hold(page)
        return found

    def register(self, page: int, chain_hash: int) -> None:
        """The prefix cache learns that `page` holds the tokens of `chain_hash` (kept as
        it is when another page already holds them)."""
        if chain_hash not in self.known and page not in self.hash_of:
            self.known[chain_hash] = page
            self.hash_of[page] = chain_hash

    def forget(self) -> None:
        """The prefix cache forgets every page (their keys were computed with other
        weights): the cached, unheld pages go back to the free list."""
        self.free.extend(reversed(self.idle))
        self.known.clear()
        self.hash_of.clear()
        self.idle.clear()

    def counts(self) -> dict:
        """{"pages_total", "pages_free", "pages_cached" (known, held by no one),
        "pages_held" (held by a sequence)}."""
        return {"pages_total": self.pages, "pages_free": len(self.free),
                "pages_cached": len(self.idle), "pages_held": int(np.sum(self.refs > 0))}
