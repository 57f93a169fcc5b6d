"""Section 6: the jitted train step of configs/gpu_1b.yaml (T 2,048; bf16 compute, float32
master weights, scanned, remat dots) at each model.matmul_precision of sizes.precisions
(jaxformer.core.low_precision): bf16 (bfloat16 operands, float32 sums: the baseline; with
model.dtype=bfloat16 it is `default`'s dot with its float32 accumulation made explicit),
fp8 (e4m3 forward, e5m2 gradients, per-tensor current scaling), fp8_rowwise (torchao's
rowwise recipe: e4m3 throughout, power-of-two scales per row and column) and int8
(per-channel, int32 sums). Every precision runs the same fixed batch
(sizes.precision_batch) over the same stream of sizes.precision_steps batches from one
seed, from the same init: tokens/s over
the steps after the first two, MFU against the given peaks (model FLOPs, the bf16 peak
for every precision) and the loss after the last step; each row's speed over the first
precision's (fp8 over bf16: the goal is >= 1.3x at 1B).

The stream is learnable: each row counts (start + i * stride) mod vocab with a random
start and stride 1..8, so the loss falls from ln(vocab) within a few steps and the
precisions' losses compare at a loss that moved."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_suite.sizes import GIB, Sizes, swept
from gpu_suite.train_step import compile_step, step_bytes, train_models
from jaxformer import Transformer, count_params, flops_per_token
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step

MAX_STRIDE = 8


def counting_stream(vocab: int, batch: int, seq: int, steps: int, seed: int = 0) -> list[dict]:
    """`steps` batches of rows counting (start + i * stride) mod vocab, on the device."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, (batch, 1))
        stride = rng.integers(1, MAX_STRIDE + 1, (batch, 1))
        rows = ((start + stride * np.arange(seq + 1)) % vocab).astype(np.int32)  # [B, T + 1]
        out.append({"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:]),
                    "loss_mask": jnp.ones((batch, seq), jnp.float32)})
    return out


def stream_run(compiled, state, stream: list[dict]):
    """(seconds per step over the steps after the first two, the last step's loss)."""
    for data in stream[:2]:
        state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for data in stream[2:]:
        state, metrics = compiled(state, data)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t0) / max(1, len(stream) - 2), float(metrics["loss"])


def precision_row(cfg, seq: int, precision: str, sizes: Sizes, batch: int, peaks) -> dict:
    cfg = dataclasses.replace(cfg, matmul_precision=precision, remat="dots")
    model = Transformer(cfg)
    steps = sizes.precision_steps
    tx, schedule = make_optimizer(OptimConfig(lr=1e-3, schedule="constant",
                                              warmup_steps=max(1, steps // 4)), cfg, steps)
    state = init_state(model, tx, 0)
    compiled, compile_s = compile_step(make_train_step(model, tx, schedule), state, cfg,
                                       batch, seq)
    stream = counting_stream(cfg.vocab_size, batch, seq, steps + 2)
    seconds, loss = stream_run(compiled, state, stream)
    tok_s = batch * seq / seconds
    flops = tok_s * flops_per_token(cfg, seq)
    row = {"precision": precision, "params": count_params(cfg), "seq": seq, "batch": batch,
           "steps": steps, "step_ms": seconds * 1e3, "tokens_per_s": tok_s,
           "model_tflops": flops / 1e12, "compile_s": compile_s,
           "step_gib_compiled": (step_bytes(compiled) or float("nan")) / GIB,
           "loss_initial": float(np.log(cfg.vocab_size)), "loss": loss}
    for key, peak in peaks.items():
        row[f"mfu_{key}"] = flops / peak if peak else None
    return row


def precision_rows(sizes: Sizes, fixed_batch, peaks) -> list[dict]:
    """One row per precision; speedup: tokens/s over the first precision's."""
    name, cfg, seq = train_models(sizes)[1]
    batch = fixed_batch or sizes.precision_batch
    return swept("precision", "precision", sizes.precisions,
                 lambda p: precision_row(cfg, seq, p, sizes, batch, peaks), {"model": name},
                 ("tokens_per_s", "speedup"))
