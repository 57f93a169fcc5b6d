"""The train/val split rules, deterministic functions of the documents' keys (never of
Python's ``hash()`` or of the machine); ``jaxformer.data.tokens`` describes how a
corpus is split with them."""

from __future__ import annotations

import hashlib
import math


def n_val(n: int, val_fraction: float) -> int:
    """How many of n documents (or tokens) go to val: round half up, then at least 1
    and at most n - 1 when val_fraction > 0."""
    if val_fraction == 0 or n < 2:
        return 0
    return min(max(1, math.floor(val_fraction * n + 0.5)), n - 1)


def val_keys(keys: list[str], val_fraction: float) -> set[str]:
    """The documents held out: those whose sha256(key) is among the n_val smallest."""
    ranked = sorted(keys, key=lambda k: (hashlib.sha256(k.encode()).digest(), k))
    return set(ranked[:n_val(len(keys), val_fraction)])
