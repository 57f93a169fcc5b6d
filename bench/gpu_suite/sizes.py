"""What bench/gpu.py's sections run at (Sizes: the real sizes, SMOKE: --smoke's tiny ones),
and how a row says it did not run."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

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
    precisions: tuple = ("bf16", "fp8", "fp8_rowwise", "int8")  # model.matmul_precision
    precision_batch: int = 16  # the 1B step at T 2,048, the same batch for each precision
    precision_steps: int = 20  # steps on the fixed batch stream; the loss after the last
    chunk_vocab: int = 152064  # loss_chunk: Qwen2.5's vocabulary
    chunk_seq: int = 4096
    chunk_batch: int = 2
    loss_chunks: tuple = (0, 256)  # model.loss_chunk (0: the plain loss)
    moe_batch: int = 8  # at T 2,048
    moe_check_rows: int = 1024  # rows of the grouped matmuls' check against the reference
    mla_batches: tuple = (1, 64)
    tiny: bool = False


SMOKE = Sizes(attn_batch=2, attn_heads=4, attn_head_dim=32, attn_seqs=(64,), window=16,
              matmul_n=256, copy_bytes=2**22, max_batch=2, steps=2, remats=("dots",),
              decode_batches=(1, 2), serve_batches=(1, 2), prompt=8, new_tokens=8,
              precision_batch=2, precision_steps=2, chunk_vocab=4096, chunk_seq=64, chunk_batch=2,
              loss_chunks=(0, 8), moe_batch=2, moe_check_rows=32,
              mla_batches=(1,), tiny=True)  # MLA: XLA:CPU runs no bf16 x bf16 -> f32 batched dot


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def first_line(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"


def swept(label: str, key: str, values, row: Callable, base: dict,
          ratio: tuple[str, str]) -> list[dict]:
    """A section's rows, one per value of a setting: {**base, **row(value)}, or a failed
    one's {**base, key: value, "status": its first line}, each printed as it ends; ratio
    (field, name): each row's field over the first row's, as `name`."""
    rows = []
    for value in values:
        try:
            rows.append({**base, **row(value)})
        except Exception as e:
            rows.append({**base, key: value, "status": first_line(e)})
        print(f"{label} row:", json.dumps(rows[-1]), flush=True)
    field, name = ratio
    first = rows[0].get(field)
    for r in rows:
        if first and field in r:
            r[name] = r[field] / first
    return rows
