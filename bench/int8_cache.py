"""The int8 KV cache's quality and bytes against bf16's, on a trained model.

    python bench/int8_cache.py [--steps 300 --runs runs/bench_int8_cache --rows 8
        --prompt 64 --new-tokens 128 --repeats 3]

configs/tiny.yaml's byte-level model (4 layers, d_model 256, 4 heads of 64) is trained
--steps steps on the standard library's source the first time, into --runs, and reused
after. The text: --rows prompts of --prompt bytes, taken at evenly spaced offsets of the
standard library's textwrap.py; each continued greedily by --new-tokens tokens with the
cache in float32, bfloat16 and int8 (generate(..., cache_dtype=...)).

Columns, each cache against the bf16 cache's greedy run: "free" is the share of positions
whose token equals bf16's when each decodes on its own (a row's tokens after its first
difference continue another text, so this counts them as they fall); "forced" is the share
of positions where the cache's greedy choice equals bf16's token when both read bf16's
text (teacher-forced: bf16's tokens fed back through this cache); bytes per token
(kv_cache_bytes at batch 1 over one token, all layers) and its ratio to bf16's; tokens/s
of greedy generate over the rows (median over --repeats rounds, caches interleaved).
Prints a Markdown table and the CPU; asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention.kv_cache import init_cache
from jaxformer.decode import generate, kv_cache_bytes

CACHES = ("float32", "bfloat16", "int8")


def trained(run_dir: pathlib.Path, steps: int):
    """(model, params, tokenizer) of configs/tiny.yaml trained `steps` steps (trained now
    unless run_dir holds that checkpoint)."""
    from jaxformer.training import load_config, train
    from jaxformer.training.saved_run import load_run
    if not (run_dir / "checkpoints" / str(steps)).is_dir():
        cfg = load_config("configs/tiny.yaml", [
            f"train.steps={steps}", f"train.run_dir={run_dir}", "train.batch_size=8",
            f"checkpoint.every={steps}", f"train.eval_every={steps}", "train.sample_tokens=0"])
        print(f"training {run_dir} ({steps} steps)", flush=True)
        train(cfg, log=lambda *args, **kw: None)
    return load_run(str(run_dir))


def prompts(tok, rows: int, width: int) -> np.ndarray:
    """[rows, width] bytes of textwrap.py at evenly spaced offsets."""
    ids = tok.encode((pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    starts = np.linspace(0, len(ids) - width - 1, rows).astype(int)
    return np.stack([np.asarray(ids[s:s + width], np.int32) for s in starts])


def forced_choices(model, params, prompt, tokens, cache_dtype):
    """The greedy choice [B, N] at each of `tokens` [B, N] (a given continuation of
    `prompt` [B, W]) with the cache in `cache_dtype`: tokens fed back, not the choices."""
    b, w = prompt.shape
    n = tokens.shape[1]

    @jax.jit
    def run(params, prompt, tokens):
        cache = init_cache(model.cfg, b, w + n, cache_dtype)
        logits, cache = model.apply({"params": params}, prompt, cache=cache)

        def step(cache, tok):
            out, cache = model.apply({"params": params}, tok[:, None], cache=cache)
            return cache, jnp.argmax(out[:, 0], -1)

        _, rest = jax.lax.scan(step, cache, tokens[:, :-1].T)
        return jnp.concatenate([jnp.argmax(logits[:, -1], -1)[:, None], rest.T], 1)

    return np.asarray(run(params, jnp.asarray(prompt), jnp.asarray(tokens)))


def cpu_name() -> str:
    found = re.search(r"model name\s*:\s*(.+)", pathlib.Path("/proc/cpuinfo").read_text())
    return found.group(1).strip() if found else "unknown CPU"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", default="runs/bench_int8_cache")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    model, params, tok = trained(pathlib.Path(a.runs), a.steps)
    cfg, x = model.cfg, prompts(tok, a.rows, a.prompt)

    def decode(dtype):
        return generate(model, params, x, max_new_tokens=a.new_tokens, rng=jax.random.key(0),
                        temperature=0.0, cache_dtype=dtype).tokens.block_until_ready()

    out = {c: np.asarray(decode(c)) for c in CACHES}  # also compiles each
    times = {c: [] for c in CACHES}
    for _ in range(a.repeats):
        for c in CACHES:
            start = time.perf_counter()
            decode(c)
            times[c].append(time.perf_counter() - start)
    base = out["bfloat16"]
    bf16_bytes = kv_cache_bytes(cfg, 1, 1, "bfloat16")
    print(f"\n{a.rows} rows x {a.new_tokens} greedy tokens = {base.size} positions after "
          f"{a.prompt}-byte prompts of textwrap.py; {a.steps} training steps; "
          f"{jax.device_count()} x {cpu_name()}\n")
    print("| cache | free: = bf16 | forced: = bf16 | KV bytes / token | vs bf16 | tokens/s |")
    print("|---|---|---|---|---|---|")
    for c in CACHES:
        forced = forced_choices(model, params, x, base, c)
        nbytes = kv_cache_bytes(cfg, 1, 1, c)
        rate = base.size / statistics.median(times[c])
        print(f"| {c} | {np.mean(out[c] == base):.1%} | {np.mean(forced == base):.1%} | "
              f"{nbytes} | {nbytes / bf16_bytes:.5f} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
