"""Host memory: keep the blocks XLA:CPU frees, so that the next step reuses them.

Each call of a compiled function allocates its temporary buffer (all the activations a
train step keeps for its backward pass: ~570 MB for the Llama shape of
bench/train_throughput.py) and frees it at the end. XLA:CPU allocates from its worker
threads, and glibc serves a block that large to a thread with a fresh mmap and returns it
with munmap: every step then faults in every page of it again, ~140,000 page faults and
~0.4 s of kernel time in a ~1.3 s step on a 2-core machine (bench/op_profile.py reports
the faults). With one malloc arena, no mmap and no trimming, the freed block stays in the
heap and the next step's allocation takes it back: no faults after the first step.

This is glibc's `mallopt`, process-wide, and must run before jax starts its CPU backend
(the worker threads pick their arena on their first allocation): `import jaxformer` does
it. It does nothing on other C libraries or systems, or with JAXFORMER_KEEP_HOST_MEMORY=0.
The cost is that the process keeps its peak heap until it exits.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc <malloc.h>


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks (see the module docstring). True if set."""
    if os.environ.get("JAXFORMER_KEEP_HOST_MEMORY", "1") == "0" or sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(option, value) == 1 for option, value in settings)
