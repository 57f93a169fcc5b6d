"""The serving engine's step, measured without HTTP: ms per decode step at 1, 8 and 32
active slots (the compiled program's share beside it), prompt tokens/s through the prefill
chunks, and bench/serve.py's workload end to end in this process: 96 requests submitted at
once into 32 slots (a closed loop of 32 clients) against static-batch generate in batches
of 32, interleaved over rounds (on a loaded machine the ratio within a round is what holds).

    python bench/engine_step.py [--d-model 256 --layers 4 --vocab 2048 --max-seq-len 512
        --requests 96 --slots 32 --rounds 3 --lengths uniform,lognormal --skip-steps
        --cache-dtype int8]

The model is bench/serve.py's shape (a random Llama-shaped decoder, GQA 8 heads over 2,
float32); the workload is serve.py's: prompts uniform in [16, 256], outputs uniform in
[16, 128] or log-normal (serve.py's LOGNORMAL) in [16, 256], every request to its length,
seeded. Each figure is taken after a first pass that compiles (Engine.warm for the runs).
--cache-dtype: the KV cache's format for the engine's pages and generate's cache alike.
Prints one table and the CPU; asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
from serve_workload import OUTPUTS  # bench/serve.py's output lengths

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.serve import Engine, RequestSettings

OUTPUT_HI = {"uniform": 128, "lognormal": 256}  # bench/serve.py's --output for each


def cpu_name() -> str:
    """lscpu's model name, or the platform's processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def model(a):
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=8,
                      n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False,
                      tie_embeddings=False, max_seq_len=a.max_seq_len, position="rope")
    m = Transformer(cfg)
    return m, m.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]


def timed_program(engine, spent):
    """engine.program wrapped: each call waited for, its seconds added to spent[kind]."""
    program = engine.program

    def run(params, pool, tokens, *rest):
        t = time.perf_counter()
        pool, out = program(params, pool, tokens, *rest)
        jax.block_until_ready(out)
        spent["decode" if tokens.shape[1] == 1 else "prefill"] += time.perf_counter() - t
        return pool, out
    engine.program = run


def decode_ms(m, params, active: int, steps: int = 20, cache_dtype=None) -> tuple[float, float]:
    """(ms per engine step, ms of it in the compiled program; medians) with `active` slots
    decoding (32 slots, prompts of 100 tokens already prefilled)."""
    engine = Engine(m, params, slots=32, cache_dtype=cache_dtype)
    for _ in range(active):
        engine.submit(list(range(1, 101)), RequestSettings(max_tokens=400, temperature=0.0))
    while any(len(r.tokens) - r.held > 1 for r in engine.running) or engine.waiting:
        engine.step()
    engine.step()  # (prompts of 100 tokens: the 20 steps timed stay within 128 keys)
    spent = {"decode": 0.0, "prefill": 0.0}
    timed_program(engine, spent)
    walls, programs = [], []
    for _ in range(steps):  # the medians: a step that compiles a new shape is not counted
        before, t = spent["decode"], time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        programs.append(spent["decode"] - before)
    return 1e3 * float(np.median(walls)), 1e3 * float(np.median(programs))


def prefill_rate(m, params, prompts: int = 8, length: int = 256, cache_dtype=None) -> float:
    """Prompt tokens/s: `prompts` prompts of `length` tokens, one new token each (the
    second round's, its prompts new: no prefix cached)."""
    engine = Engine(m, params, slots=32, cache_dtype=cache_dtype)
    for rounds in range(2):
        t = time.perf_counter()
        for i in range(prompts):
            engine.submit([1 + (i * 7 + j + 61 * rounds) % 500 for j in range(length)],
                          RequestSettings(max_tokens=1, temperature=0.0))
        while engine.has_work():
            engine.step()
    return prompts * length / (time.perf_counter() - t)


def workload(n: int, lengths: str, seed: int = 0):
    """bench/serve.py's jobs: prompts uniform in [16, 256], outputs by `lengths` in [16, 128]
    (uniform) or [16, 256] (lognormal: serve.py's long tail); random ids, seeded."""
    draw = np.random.default_rng(seed)
    prompts = draw.integers(16, 257, n)
    outputs = OUTPUTS[lengths](draw, 16, OUTPUT_HI[lengths], n)
    return [([int(x) for x in draw.integers(1, 1000, int(p))], int(o))
            for p, o in zip(prompts, outputs)]


def engine_run(engine, jobs) -> tuple[float, dict]:
    """(seconds, {"decode", "prefill": seconds in programs}) of every job submitted at once
    into the engine's slots (a closed loop of as many clients), its prefix cache emptied
    first (the programs compiled by Engine.warm)."""
    engine.host.forget()
    spent = {"decode": 0.0, "prefill": 0.0}
    program = engine.program
    timed_program(engine, spent)
    t = time.perf_counter()
    for prompt, new in jobs:
        engine.submit(prompt, RequestSettings(max_tokens=new, min_tokens=new, temperature=0.0))
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t
    engine.program = program
    return wall, spent


def static_run(m, params, jobs, batch: int, cache_dtype=None) -> float:
    """Seconds of generate over the jobs in batches of `batch` (each to its longest output,
    its prompts right-padded to the longest of all)."""
    width = max(len(p) for p, _ in jobs)

    def run(group):
        prompts = np.zeros((len(group), width), np.int32)
        for r, (p, _) in enumerate(group):
            prompts[r, :len(p)] = p
        out = generate(m, params, prompts, max_new_tokens=max(o for _, o in group),
                       prompt_lengths=np.array([len(p) for p, _ in group], np.int32),
                       rng=jax.random.key(0), temperature=0.0, cache_dtype=cache_dtype)
        return jax.block_until_ready(out.tokens)
    groups = [jobs[i:i + batch] for i in range(0, len(jobs), batch)]
    t = time.perf_counter()
    for g in groups:
        run(g)
    return time.perf_counter() - t


def against_static(m, params, a, lengths: str) -> list[tuple]:
    """The engine (a.slots slots) and static generate (batches of a.slots) on a.requests
    jobs, interleaved a.rounds times (a loaded machine: the ratio of each round, the
    medians); rows for the table."""
    jobs = workload(a.requests, lengths)
    tokens = sum(o for _, o in jobs)
    engine = Engine(m, params, slots=a.slots, cache_dtype=a.cache_dtype)
    engine.warm()
    static_run(m, params, jobs, a.slots, a.cache_dtype)  # compiles each batch's shape
    runs = [(engine_run(engine, jobs), static_run(m, params, jobs, a.slots, a.cache_dtype))
            for _ in range(a.rounds)]
    ratios = [static / wall for (wall, _), static in runs]
    (wall, spent), static = runs[int(np.argsort(ratios)[len(ratios) // 2])]
    name = f"{a.requests} requests in {a.slots} slots, outputs {lengths}"
    return [(f"engine, {name}", f"{tokens / wall:.0f} tok/s",
             f"{wall:.2f} s (decode {spent['decode']:.2f}, prefill {spent['prefill']:.2f})"),
            (f"static generate, batches of {a.slots}", f"{tokens / static:.0f} tok/s",
             f"{static:.2f} s; engine {np.median(ratios):.2f}x (rounds "
             + ", ".join(f"{r:.2f}" for r in ratios) + ")")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", default="uniform,lognormal")
    p.add_argument("--skip-steps", action="store_true", help="only the runs against static")
    p.add_argument("--cache-dtype", default=None, help="the KV cache's format (int8, "
                   "bfloat16; default the model's float32)")
    a = p.parse_args(argv)
    m, params = model(a)
    rows = []
    for active in () if a.skip_steps else (1, 8, 32):
        step, prog = decode_ms(m, params, active, cache_dtype=a.cache_dtype)
        rows.append((f"decode step, {active} active of 32 slots", f"{step:.2f} ms",
                     f"program {prog:.2f} ms"))
    if not a.skip_steps:
        rows.append(("prefill, 8 prompts x 256",
                     f"{prefill_rate(m, params, cache_dtype=a.cache_dtype):.0f} tok/s", ""))
    for lengths in a.lengths.split(","):
        rows += against_static(m, params, a, lengths)
    print(f"d_model {a.d_model} x {a.layers} layers, vocab {a.vocab}, max_seq_len "
          f"{a.max_seq_len}, cache {a.cache_dtype or 'float32'}; CPU: {cpu_name()}, "
          f"{jax.local_device_count()} device(s)")
    for row in rows:
        print(f"| {row[0]:<40} | {row[1]:>14} | {row[2]:<44} |")


if __name__ == "__main__":
    main()
