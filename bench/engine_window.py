"""The serving engine on a model whose every layer has a sliding window: pages behind each
request's window released (the engine's default for such a model) against every page kept
(Engine.window = None, as for a model with a full-attention layer), same requests.

    python bench/engine_window.py [--window 64 --prompt 256 --new 512 --requests 32
        --d-model 256 --layers 4 --rounds 2]

A random Llama-shaped decoder (GQA 8 heads over 2, float32, max_seq_len 1024) with
sliding_window --window; --requests greedy requests of --prompt random tokens and --new
tokens each (min_tokens = max_tokens), submitted at once into as many slots, pages of 16.
Each run follows an untimed one (its programs compiled); the two settings alternate over
--rounds. Prints output tokens/s, seconds, steps and the most pages held at once, and the
CPU; asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
from engine_step import cpu_name

from jaxformer import ModelConfig, Transformer
from jaxformer.serve import Engine, RequestSettings


def timed(engine, jobs) -> tuple[float, int, int]:
    """(seconds, steps, the most pages held at once) of every job through the engine."""
    for prompt, new in jobs:
        engine.submit(prompt, RequestSettings(max_tokens=new, min_tokens=new, temperature=0.0))
    t, steps, peak = time.perf_counter(), 0, 0
    while engine.has_work():
        engine.step()
        steps += 1
        peak = max(peak, engine.stats()["pages_held"])
    engine.host.forget()
    return time.perf_counter() - t, steps, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("window", 64), ("prompt", 256), ("new", 512), ("requests", 32),
                          ("d-model", 256), ("layers", 4), ("rounds", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    cfg = ModelConfig(vocab_size=2048, d_model=a.d_model, n_layers=a.layers, n_heads=8,
                      n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False,
                      tie_embeddings=False, max_seq_len=1024, position="rope",
                      sliding_window=a.window)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    draw = np.random.default_rng(0)
    jobs = [(draw.integers(1, 2000, a.prompt).tolist(), a.new) for _ in range(a.requests)]
    engines = {"pages behind the window released": Engine(model, params, slots=a.requests),
               "every page kept": Engine(model, params, slots=a.requests)}
    engines["every page kept"].window = None
    for engine in engines.values():
        timed(engine, jobs)  # compiles
    runs = {name: [] for name in engines}
    for _ in range(a.rounds):  # interleaved: the machine's noise falls on both
        for name, e in engines.items():
            runs[name].append(timed(e, jobs))
    print(f"window {a.window}, {a.requests} requests of {a.prompt} + {a.new} tokens, d_model "
          f"{a.d_model} x {a.layers} layers; CPU: {cpu_name()}")
    pool = next(iter(engines.values())).stats()["pages_total"]
    for name, rs in runs.items():
        wall = float(np.median([r[0] for r in rs]))
        print(f"| {name:<34} | {a.requests * a.new / wall:>7.0f} tok/s | {wall:6.2f} s | "
              f"{rs[0][1]} steps | most pages held {rs[0][2]} of {pool} |")


if __name__ == "__main__":
    main()
