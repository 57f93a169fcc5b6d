"""The serving engine's step, measured without HTTP: ms per decode step at 1, 8 and 32
active slots (the compiled program's share beside it), prompt tokens/s through the prefill
chunks, and 32 requests end to end through the engine against one static-batch generate.

    python bench/engine_step.py [--d-model 256 --layers 4 --vocab 2048 --max-seq-len 512]

The model is bench/serve.py's shape (a random Llama-shaped decoder, GQA 8 heads over 2,
float32); the workload: prompts uniform in [16, 256], outputs uniform in [16, 128] (every
request to its length), seeded. Each figure is taken after a first pass that compiles.
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

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.serve import Engine, RequestSettings


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


def decode_ms(m, params, active: int, steps: int = 20) -> tuple[float, float]:
    """(ms per engine step, ms of it in the compiled program; medians) with `active` slots
    decoding (32 slots, prompts of 100 tokens already prefilled)."""
    engine = Engine(m, params, slots=32)
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


def prefill_rate(m, params, prompts: int = 8, length: int = 256) -> float:
    """Prompt tokens/s: `prompts` prompts of `length` tokens, one new token each (the
    second round's, its prompts new: no prefix cached)."""
    engine = Engine(m, params, slots=32)
    for rounds in range(2):
        t = time.perf_counter()
        for i in range(prompts):
            engine.submit([1 + (i * 7 + j + 61 * rounds) % 500 for j in range(length)],
                          RequestSettings(max_tokens=1, temperature=0.0))
        while engine.has_work():
            engine.step()
    return prompts * length / (time.perf_counter() - t)


def workload(n: int, seed: int = 0):
    draw = np.random.default_rng(seed)
    return [([int(x) for x in draw.integers(1, 1000, int(p))], int(o)) for p, o in
            zip(draw.integers(16, 257, n), draw.integers(16, 129, n))]


def engine_run(m, params, jobs) -> tuple[float, dict]:
    """(seconds, seconds in programs) for jobs submitted together into len(jobs) slots: the
    second of two runs, each on a fresh engine (no prefix cached; the programs compiled)."""
    for rounds in range(2):
        engine = Engine(m, params, slots=len(jobs))
        spent = {"decode": 0.0, "prefill": 0.0}
        if rounds:
            timed_program(engine, spent)
        t = time.perf_counter()
        for prompt, new in jobs:
            engine.submit(prompt, RequestSettings(max_tokens=new, min_tokens=new,
                                                  temperature=0.0))
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - t
    return wall, spent


def static_run(m, params, jobs) -> float:
    """Seconds of one generate over the jobs as one batch (to the longest output)."""
    width = max(len(p) for p, _ in jobs)
    prompts = np.zeros((len(jobs), width), np.int32)
    for r, (p, _) in enumerate(jobs):
        prompts[r, :len(p)] = p
    lengths = np.array([len(p) for p, _ in jobs], np.int32)
    new = max(o for _, o in jobs)

    def run():
        out = generate(m, params, prompts, prompt_lengths=lengths, max_new_tokens=new,
                       rng=jax.random.key(0), temperature=0.0)
        return jax.block_until_ready(out.tokens)
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=32)
    a = p.parse_args(argv)
    m, params = model(a)
    rows = []
    for active in (1, 8, 32):
        step, prog = decode_ms(m, params, active)
        rows.append((f"decode step, {active} active of 32 slots", f"{step:.2f} ms",
                     f"program {prog:.2f} ms"))
    rows.append(("prefill, 8 prompts x 256", f"{prefill_rate(m, params):.0f} tok/s", ""))
    jobs = workload(a.requests)
    tokens = sum(o for _, o in jobs)
    wall, spent = engine_run(m, params, jobs)
    rows.append((f"engine, {len(jobs)} requests together", f"{tokens / wall:.0f} tok/s",
                 f"{wall:.2f} s (decode {spent['decode']:.2f}, prefill {spent['prefill']:.2f})"))
    static = static_run(m, params, jobs)
    rows.append((f"static generate, batch {len(jobs)}", f"{tokens / static:.0f} tok/s",
                 f"{static:.2f} s"))
    print(f"d_model {a.d_model} x {a.layers} layers, vocab {a.vocab}, max_seq_len "
          f"{a.max_seq_len}; CPU: {cpu_name()}, {jax.local_device_count()} device(s)")
    for row in rows:
        print(f"| {row[0]:<40} | {row[1]:>14} | {row[2]:<44} |")


if __name__ == "__main__":
    main()
