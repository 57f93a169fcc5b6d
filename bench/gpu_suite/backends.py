"""Section 1: attention backends in bf16 on every mask kind (MASK_CASES), as the model
calls them (is_causal, plus a mask array or a bias where the kind has one): max error
against the float32 reference, forward and forward+backward ms; and tests/attention/'s
cuDNN tests."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from attention import timed  # bench/attention.py: compile s, median s, bytes

from gpu_suite.sizes import NO_GPU, Sizes, first_line, on_gpu
from jaxformer.attention import dot_product_attention, make_attention_mask
from jaxformer.attention.backends import backends_here
from jaxformer.positions import alibi_bias, alibi_slopes, segment_positions

ATTENTION_IMPLS = ("cudnn", "xla", "reference")  # reference: also the float32 truth


def padding_segments(rng: np.random.Generator, b: int, t: int):
    """Segment ids [b, t]: each row real (1) up to a random length, padding (0) after."""
    lengths = rng.integers(t // 2, t + 1, (b, 1))
    return jnp.asarray((np.arange(t) < lengths).astype(np.int32))


def packed_segments(rng: np.random.Generator, b: int, t: int):
    """Segment ids [b, t] from 1: documents of random lengths packed in each row."""
    starts = np.zeros((b, t), np.int32)
    starts[:, rng.integers(1, t, 3 * t // 64 + 1)] = 1
    return jnp.asarray(1 + np.cumsum(starts, axis=1).astype(np.int32))


@dataclasses.dataclass(frozen=True)
class MaskCase:
    """One mask kind. With segments or a window the mask travels as an array beside
    is_causal (an argument: closed over, XLA would embed it as a constant, and ALiBi's
    bias at T 8,192 is 4.3 GB)."""
    segments: Callable | None = None  # (rng, b, t) -> segment ids [b, t]; None: one document
    restart: bool = False    # positions restart in each segment (packed documents)
    windowed: bool = False   # keys within sizes.window of the query only
    alibi: bool = False      # ALiBi's bias
    kv_share: int = 1        # query heads per K/V head


MASK_CASES = {"causal": MaskCase(), "padding": MaskCase(padding_segments),
              "packed": MaskCase(packed_segments, restart=True),
              "window": MaskCase(windowed=True), "alibi": MaskCase(alibi=True),
              "gqa": MaskCase(kv_share=4)}
MASK_KINDS = tuple(MASK_CASES)


def attention_case(kind: str, sizes: Sizes, t: int, rng: np.random.Generator):
    """(q, k, v float32, kwargs) for one mask kind at length t, as the model calls it."""
    case = MASK_CASES[kind]
    b, n, h = sizes.attn_batch, sizes.attn_heads, sizes.attn_head_dim
    kv = n // case.kv_share
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, heads, h), np.float32))
               for heads in (n, kv, kv))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = None if case.segments is None else case.segments(rng, b, t)
    if case.restart:
        pos = segment_positions(seg)
    arrays = {}
    if seg is not None or case.windowed:
        arrays["mask"] = make_attention_mask(pos, pos, seg, seg, causal=True,
                                             window=sizes.window if case.windowed else None)
    if case.alibi:
        arrays["bias"] = alibi_bias(alibi_slopes(n), pos, pos)
    return q, k, v, arrays


def attend(q, k, v, arrays, impl):
    return dot_product_attention(q, k, v, impl=impl, is_causal=True, **arrays)


def backend_row(row: dict, q, k, v, arrays, truth, repeats: int) -> dict:
    """row (mask, seq, impl) with the backend's bf16 error and times, or why not."""
    impl = row["impl"]
    if impl not in backends_here():  # cudnn, off a GPU
        return dict(row, status=NO_GPU)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    fwd = lambda q, k, v, arrays: attend(q, k, v, arrays, impl)  # noqa: E731
    grad = jax.grad(lambda q, k, v, arrays: jnp.sum(fwd(q, k, v, arrays).astype(jnp.float32)),
                    argnums=(0, 1, 2))
    try:
        out = jax.jit(fwd)(qb, kb, vb, arrays)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - truth)))
        _, fwd_s, _ = timed(fwd, qb, kb, vb, arrays, repeats=repeats)
        _, bwd_s, _ = timed(grad, qb, kb, vb, arrays, repeats=repeats)
    except Exception as e:  # e.g. cuDNN refusing a shape, or out of memory
        return dict(row, status=first_line(e))
    row = dict(row, status="ok", max_err=err, fwd_ms=fwd_s * 1e3, fwd_bwd_ms=bwd_s * 1e3)
    print("attention row:", json.dumps(row), flush=True)
    return row


def attention_rows(sizes: Sizes, repeats: int, masks=MASK_KINDS) -> list[dict]:
    rng = np.random.default_rng()
    rows = []
    for t in sizes.attn_seqs:
        for kind in masks:
            q, k, v, arrays = attention_case(kind, sizes, t, rng)
            truth = jax.jit(attend, static_argnums=4)(q, k, v, arrays, "reference")
            rows += [backend_row({"mask": kind, "seq": t, "impl": impl}, q, k, v, arrays, truth,
                                 repeats) for impl in ATTENTION_IMPLS]
            del q, k, v, arrays, truth
    return rows


def cudnn_tests(repo) -> dict:
    """tests/attention/'s cuDNN tests, run by pytest in a subprocess."""
    if not on_gpu():
        return {"status": NO_GPU}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/attention", "-k", "cudnn"]
    try:
        # this process holds most of the GPU's memory: the tests allocate as they go
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=1800, env=env)
    except Exception as e:
        return {"status": first_line(e)}
    lines = (r.stdout + r.stderr).strip().splitlines()
    return {"status": "passed" if r.returncode == 0 else f"failed (exit {r.returncode})",
            "summary": lines[-1] if lines else ""}
