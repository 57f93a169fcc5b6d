"""Host memory: keep the blocks XLA:CPU frees, so that the next step reuses them.

Each call of a compiled function allocates its temporary buffer (all the activations a
train step keeps for its backward pass: ~570 MB for the Llama shape of
bench/train_throughput.py) and frees it at the end. By default jax runs a CPU computation
on a worker thread, and glibc serves a block that large to a thread with a fresh mmap and
returns it with munmap: every step then faulted in every page of it again, ~140,000 page
faults and ~0.4 s of kernel time in a ~1.3 s step on a 2-core machine.

Two settings fix it, both process-wide and both needing to come before jax starts its CPU
backend (`import jaxformer` does it):
- jax runs single-device CPU computations in the calling thread
  (`jax_cpu_enable_async_dispatch=False`), so the buffer comes from glibc's main arena,
  the only one that can hold a block that large without mmap. The calling thread then
  waits for each computation: for a train step of ~1 s, the ~1 ms of Python between steps
  no longer overlaps it. Computations over several devices stay asynchronous.
- glibc's malloc uses no mmap and keeps freed memory (`mallopt`): the block stays in the
  heap and the next call takes it back. The process keeps its peak heap until it exits.
(Forcing one malloc arena for every thread also works, but it made the `tokenizers`
library's multi-threaded BPE training 3.5x slower.) Nothing changes on other C libraries
or systems, or with JAXFORMER_KEEP_HOST_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import os
import sys

import jax

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc <malloc.h>


def keep_freed_memory() -> bool:
    """Apply the settings above, before jax's CPU backend starts. True if they were set."""
    if os.environ.get("JAXFORMER_KEEP_HOST_MEMORY", "1") == "0" or sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    if not all(mallopt(option, value) == 1
               for option, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))):
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
