"""Section 3: the jitted train step of gpt2-small (T 1,024) and configs/gpu_1b.yaml
(T 2,048), bf16 compute, float32 params, scanned layers, at each remat policy, at the
largest power-of-two batch the compiler says fits in 90% of device memory (or a fixed
batch): tokens/s, model TFLOP/s, MFU against the given peaks, memory and compile seconds."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_suite.sizes import GIB, Sizes, first_line
from jaxformer import ModelConfig, Transformer, count_params, flops_per_token
from jaxformer.training import load_config
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step

REPO = pathlib.Path(__file__).resolve().parents[2]


def shrink(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at --smoke size."""
    kv = 2 if cfg.n_kv_heads < cfg.n_heads else 4
    return dataclasses.replace(cfg, vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                               n_kv_heads=kv, d_ff=128, max_seq_len=64)


def train_models(sizes: Sizes) -> list[tuple[str, ModelConfig, int]]:
    """(name, config, seq_len): gpt2-small and the 1B config, bf16 compute, scanned."""
    gpt2 = ModelConfig.preset("gpt2-small", vocab_size=50304)
    llama = load_config(str(REPO / "configs/gpu_1b.yaml")).model
    models = [("gpt2-small", gpt2, 1024), ("gpu_1b", llama, 2048)]
    out = []
    for name, cfg, seq in models:
        cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32",
                                  scan_layers=True)
        if sizes.tiny:
            cfg, seq = shrink(cfg), 32
        out.append((name, cfg, seq))
    return out


def step_bytes(compiled) -> int | None:
    """Arguments + temporaries + any output that does not alias a donated argument."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.temp_size_in_bytes + \
        max(0, m.output_size_in_bytes - m.alias_size_in_bytes)


def batch_of(cfg: ModelConfig, batch: int, seq: int):
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "loss_mask": jnp.ones((batch, seq), jnp.float32)}


def device_bytes_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def compile_step(step, state, cfg, batch: int, seq: int):
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_of(cfg, batch, seq)).compile()
    return compiled, time.perf_counter() - t0


def largest_batch(step, state, cfg, seq: int, sizes: Sizes):
    """(batch, compiled step, compile s): the largest power of two whose compiled step
    fits in 90% of device memory, predicted from batches 1 and 2 (memory is linear in
    the batch) and then checked; without a known limit (CPU), sizes.max_batch."""
    limit = device_bytes_limit()
    if limit is None:
        return (sizes.max_batch, *compile_step(step, state, cfg, sizes.max_batch, seq))
    one, _ = compile_step(step, state, cfg, 1, seq)
    two, _ = compile_step(step, state, cfg, 2, seq)
    per_row = max(1, step_bytes(two) - step_bytes(one))
    fits = max(1, int((0.9 * limit - step_bytes(one) + per_row) // per_row))
    batch = min(sizes.max_batch, 1 << (fits.bit_length() - 1))
    while True:
        compiled, seconds = compile_step(step, state, cfg, batch, seq)
        if batch == 1 or step_bytes(compiled) <= 0.9 * limit:
            return batch, compiled, seconds
        batch //= 2


def seconds_per_step(compiled, state, data, steps: int):
    """(seconds per step, the last metrics) over `steps` steps after two to warm up."""
    for _ in range(2):
        state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, data)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t0) / steps, metrics


def train_row(name, cfg, seq, remat, sizes: Sizes, fixed_batch, peaks) -> dict:
    cfg = dataclasses.replace(cfg, remat=remat)
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    step = make_train_step(model, tx, schedule)
    state = init_state(model, tx, 0)
    if fixed_batch:
        batch = fixed_batch
        compiled, compile_s = compile_step(step, state, cfg, batch, seq)
    else:
        batch, compiled, compile_s = largest_batch(step, state, cfg, seq, sizes)
    seconds, metrics = seconds_per_step(compiled, state, batch_of(cfg, batch, seq), sizes.steps)
    tok_s = batch * seq / seconds
    flops = tok_s * flops_per_token(cfg, seq)
    stats = jax.devices()[0].memory_stats() or {}
    row = {"model": name, "params": count_params(cfg), "seq": seq, "remat": remat,
           "batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": tok_s,
           "model_tflops": flops / 1e12, "compile_s": compile_s,
           "step_gib_compiled": (step_bytes(compiled) or float("nan")) / GIB,
           "device_peak_gib_so_far": stats.get("peak_bytes_in_use", float("nan")) / GIB,
           "loss": float(metrics["loss"]) if "loss" in metrics else None}
    for key, peak in peaks.items():
        row[f"mfu_{key}"] = flops / peak if peak else None
    return row


def train_rows(sizes: Sizes, fixed_batch, peaks) -> list[dict]:
    rows = []
    for name, cfg, seq in train_models(sizes):
        for remat in sizes.remats:
            try:
                rows.append(train_row(name, cfg, seq, remat, sizes, fixed_batch, peaks))
            except Exception as e:
                rows.append({"model": name, "seq": seq, "remat": remat, "status": first_line(e)})
            print("train row:", json.dumps(rows[-1]), flush=True)  # kept if a later row times out
    return rows
