"""Batch-1 greedy decoding drafted by the model's own multi-token prediction module
(generate(..., draft="mtp"), jaxformer.decode.speculative.mtp_proposer): speed-up over plain
decoding and acceptance rate, beside prompt lookup.

    python bench/mtp_decode.py [--steps 300 --prompt 64 --new-tokens 128 --repeats 3
                                --layers 4 --d-model 256 --runs runs/bench_mtp]

A model of configs/tiny.yaml's shape (default 4 layers, d_model 256, 4 heads, bytes) with
model.mtp_depth=1 is trained on the default corpus (the standard library's source) the first
time, into --runs (a folder per shape), and reused after (bench/decode_limit.trained). The prompt is the first --prompt
bytes of textwrap.py. Rows: plain greedy; mtp with 1 draft a round (module 1), and 2 and 3
(module 1 chained on its own hidden state); prompt lookup with 1 and 3. tokens/s is the
median over rounds (every decoder once per round, interleaved); accept: drafted tokens
kept; "same": the tokens are plain greedy's.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np

from decode_limit import code_prompt, cpu_name, timed_rounds, trained
from jaxformer.decode import generate

MODEL = ["model.mtp_depth=1", "model.max_seq_len=1024", "train.mtp_weight=0.3"]


def decoders(model, params, prompt, new_tokens: int) -> dict:
    """{name: fn() -> Generated}: plain, mtp and prompt lookup at a few draft lengths."""
    def run(draft=None, k=1):
        def fn():
            out = generate(model, params, prompt, max_new_tokens=new_tokens,
                           rng=jax.random.key(0), temperature=0.0, draft=draft, draft_len=k)
            return jax.block_until_ready(out)
        return fn
    rows = {"plain greedy": run()}
    rows.update({f"mtp, k={k}" + (" (chained)" if k > model.cfg.mtp_depth else ""):
                 run("mtp", k) for k in (1, 2, 3)})
    rows.update({f"prompt lookup, k={k}": run("prompt_lookup", k) for k in (1, 3)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default="runs/bench_mtp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    a = p.parse_args()
    shape = [f"model.n_layers={a.layers}", f"model.d_model={a.d_model}",
             f"model.n_heads={a.heads}"]
    run = pathlib.Path(a.runs) / f"mtp1_{a.layers}x{a.d_model}"
    model, params, tok = trained(run, MODEL + shape, a.steps)
    prompt = code_prompt(tok, a.prompt)
    results = timed_rounds(decoders(model, params, prompt, a.new_tokens), a.repeats)
    c = model.cfg
    print(f"CPU: {cpu_name()}; {c.n_layers} layers, d_model {c.d_model}, mtp_depth "
          f"{c.mtp_depth}, trained {a.steps} steps; prompt {prompt.shape[1]} bytes of "
          f"textwrap.py, {a.new_tokens} new tokens, greedy, batch 1")
    header = f"{'decoder':<26} {'tokens/s':>9} {'accept':>7} {'vs plain':>9} {'same':>5}"
    print(header + "\n" + "-" * len(header))
    base, want = results["plain greedy"][0], np.asarray(results["plain greedy"][1].tokens[0])
    for name, (sec, out) in results.items():
        accept = "-" if out.drafted is None else f"{out.acceptance_rate:.2f}"
        same = "yes" if np.array_equal(np.asarray(out.tokens[0]), want) else "no"
        print(f"{name:<26} {a.new_tokens / sec:>9,.1f} {accept:>7} {base / sec:>8.2f}x "
              f"{same:>5}")


if __name__ == "__main__":
    main()
