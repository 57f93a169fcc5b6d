"""What bench/gpu.py's sections run at (Sizes: the real sizes, SMOKE: --smoke's tiny ones),
and how a row says it did not run."""

from __future__ import annotations

import dataclasses

import jax

NO_GPU = "skipped: no GPU"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs at: the real sizes, or --smoke's tiny ones."""
    attn_batch: int = 1
    attn_heads: int = 16
    attn_head_dim: int = 128
    attn_seqs: tuple = (2048, 8192)
    window: int = 1024
    matmul_n: int = 8192
    copy_bytes: int = 2 * GIB
    max_batch: int = 256
    steps: int = 10
    remats: tuple = ("none", "dots", "full")
    decode_batches: tuple = (1, 64)
    serve_batches: tuple = (1, 16, 64)  # concurrent sequences in the serving engine
    prompt: int = 128
    new_tokens: int = 256
    tiny: bool = False


SMOKE = Sizes(attn_batch=2, attn_heads=4, attn_head_dim=32, attn_seqs=(64,), window=16,
              matmul_n=256, copy_bytes=2**22, max_batch=2, steps=2, remats=("dots",),
              decode_batches=(1, 2), serve_batches=(1, 2), prompt=8, new_tokens=8, tiny=True)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def first_line(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
