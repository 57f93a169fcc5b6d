"""Section 4: generate() on the 1B config with bf16 params and cache at each batch,
against the memory roofline: (param bytes + KV cache bytes) read per step over the copy
bandwidth measured in the same run."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_suite.sizes import Sizes
from gpu_suite.train_step import train_models
from jaxformer import Transformer
from jaxformer.decode import generate, kv_cache_bytes


def median_seconds(run, repeats: int) -> tuple[float, float]:
    """(the first call's seconds, the median of `repeats` more): run() -> arrays."""
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def bf16_model(cfg):
    """(Transformer, its params in bfloat16, their bytes) of cfg with bf16 params."""
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    model = Transformer(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return model, params, sum(x.nbytes for x in jax.tree.leaves(params))


def greedy_call(model, params, batch: int, sizes: Sizes):
    """run() -> tokens: generate() greedy with a bf16 cache on `batch` random prompts of
    sizes.prompt tokens, sizes.new_tokens new ones."""
    prompts = np.random.default_rng(0).integers(1, model.cfg.vocab_size, (batch, sizes.prompt))

    def run():
        return generate(model, params, prompts, max_new_tokens=sizes.new_tokens,
                        rng=jax.random.key(0), temperature=0.0, cache_dtype=jnp.bfloat16).tokens
    return run


def generate_row(name, model, params, param_bytes, batch, sizes: Sizes, bandwidth: float,
                 repeats: int) -> dict:
    """generate()'s tokens/s at one batch (greedy, bf16 cache) against the roofline."""
    cfg = model.cfg
    first, seconds = median_seconds(greedy_call(model, params, batch, sizes), repeats)
    tok_s = batch * sizes.new_tokens / seconds
    cache = kv_cache_bytes(cfg, batch, sizes.prompt + sizes.new_tokens, jnp.bfloat16)
    per_step = param_bytes + cache
    roofline = batch * bandwidth / per_step
    return {"model": name, "batch": batch, "prompt": sizes.prompt,
            "new_tokens": sizes.new_tokens, "tokens_per_s": tok_s,
            "ms_per_step": seconds / sizes.new_tokens * 1e3, "compile_s": first - seconds,
            "cache_bytes": cache, "bytes_per_step": per_step,
            "roofline_tokens_per_s": roofline, "of_roofline": tok_s / roofline}


def decode_rows(sizes: Sizes, bandwidth: float, repeats: int) -> list[dict]:
    """generate() tokens/s on the 1B config, bf16 params and cache, against the roofline."""
    name, cfg, _ = train_models(sizes)[1]
    model, params, param_bytes = bf16_model(cfg)
    return [generate_row(name, model, params, param_bytes, batch, sizes, bandwidth, repeats)
            for batch in sizes.decode_batches]
