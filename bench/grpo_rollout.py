"""A rollout-heavy GRPO step through the serving engine against the in-jit generate
(objective.rollout=engine / generate, training/grpo_step.py), in one process, interleaved.

    python bench/grpo_rollout.py [--d-model 64 --layers 2 --prompts 8 --group 16
        --new 128 --eos-bias 2.5 --steps 6]

The workload: --prompts "a+b=" prompts a step x --group completions each at temperature 1,
up to --new tokens, task:addition (the one-program form: generate's rollout traced inside
the jitted step; the engine's made before it), one inner step, beta 0. The model is a
random decoder (a byte-level BPE of 257 tokens) whose LM head has a bias of --eos-bias on
the end of text, so most completions end within a few dozen tokens and a few run long:
generate's fixed-length scan runs every row for all --new tokens, the engine stops a row
at its end of text and the batch at its longest row. Each form's state is its own copy
(the update donates it), both start from the same weights and draw the same prompts.

Timed after --warm steps (compiles; the engine's warm() compiles every program a rollout
may run before the first): the whole step (rollout + reward + update, waited
for), the rollout alone (the same prompts and weights again, the host form's rollout:
generate fetched / the engine) and the update (the step less its rollout: the engine's
logged rollout_s; generate's, traced inside the step, the rollout timed alone), medians
over --steps, with each form's completion lengths (mean and longest). Prints a table and
the CPU; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a checkout's own

import jax

from bench.engine_step import cpu_name
from jaxformer import ModelConfig
from jaxformer.data import DataConfig, load_dataset
from jaxformer.data.tokenizer import train_bpe
from jaxformer.model.build import model_for
from jaxformer.training.config import (
    ObjectiveConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from jaxformer.training.grpo_step import GroupPolicy, rollout_engine
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import init_state

FORMS = ("generate", "engine")


def run_config(a, tmp: pathlib.Path, rollout: str) -> RunConfig:
    """The bench's GRPO run (the module docstring's workload) with objective.rollout."""
    model = ModelConfig(vocab_size=257, d_model=a.d_model, n_layers=a.layers,
                        n_heads=max(1, a.d_model // 16), max_seq_len=16 + a.new,
                        head_bias=True)
    return RunConfig(
        model=model,
        data=DataConfig(format="prompt_completion", path=str(tmp / "train.jsonl"),
                        tokenizer=str(tmp / "tokenizer.json"), val_fraction=0.05,
                        cache_dir=str(tmp / "cache")),
        train=TrainConfig(init_from="random", seq_len=16 + a.new, batch_size=a.prompts,
                          steps=a.warm + a.steps, seed=0, progress=False),
        optim=OptimConfig(warmup_steps=0),
        objective=ObjectiveConfig(name="grpo", reward="task:addition", beta=0.0,
                                  group_size=a.group, max_new_tokens=a.new, temperature=1.0,
                                  inner_steps=1, rollout=rollout))


def setup(a, tmp: pathlib.Path):
    """(data, model, the initial state with the end of text's head bias, {form: step})."""
    r = np.random.default_rng(0)
    rows = [{"prompt": f"{x}+{y}=", "completion": f"{x + y}"}
            for x, y in r.integers(0, 100, (500, 2)).tolist()]
    (tmp / "train.jsonl").write_text("\n".join(json.dumps(x) for x in rows))
    train_bpe(iter("0123456789+="), 257).save(tmp)
    cfgs = {f: run_config(a, tmp, f) for f in FORMS}
    cfg = cfgs["generate"]
    data = load_dataset(cfg.data, run_dir=str(tmp), vocab_size=257, progress=False,
                        log=lambda *x: None)
    model = model_for(cfg.model)
    tx, _ = make_optimizer(cfg.optim, cfg.model, cfg.train.steps)
    state = init_state(model, tx, 0)
    bias = state.params["head_bias"].at[data.tokenizer.eot_id].set(a.eos_bias)
    state = state.replace(params={**state.params, "head_bias": bias})
    steps = {f: GroupPolicy(c).rollout_step(model, data, None) for f, c in cfgs.items()}
    return state, steps


def rollout_seconds(step, params, index: int) -> tuple[float, np.ndarray]:
    """(seconds, completion lengths) of step's rollout alone at step `index`'s prompts."""
    prompts, lengths, _ = step.batch(index)
    key = jax.random.fold_in(jax.random.key(step.seed), index)
    t = time.perf_counter()
    _, _, counts = step.kind.host(step, params, prompts, lengths, key)
    return time.perf_counter() - t, np.asarray(counts)


def measure(a, state, steps) -> dict:
    """{form: {"step", "rollout", "update": [seconds], "mean", "longest": [tokens]}}: the
    steps interleaved, each form's rollout timed again alone after its step."""
    states = {f: jax.tree.map(lambda x: x.copy(), state) for f in FORMS}
    out = {f: {k: [] for k in ("step", "rollout", "update", "mean", "longest")} for f in FORMS}
    rows = a.prompts * a.group  # the engine's, made now: every program a rollout may run
    rollout_engine(steps["engine"], states["engine"].params, rows).warm()
    for i in range(a.warm + a.steps):
        for f in FORMS:
            t = time.perf_counter()
            states[f], m = steps[f](states[f], i)
            jax.block_until_ready((states[f], m))
            took = time.perf_counter() - t
            seconds, counts = rollout_seconds(steps[f], states[f].params, i)
            update = took - float(m.get("rollout_s", seconds))  # generate's: in the step
            if i >= a.warm:
                for k, v in (("step", took), ("rollout", seconds), ("update", update),
                             ("mean", counts.mean()), ("longest", counts.max())):
                    out[f][k].append(float(v))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--eos-bias", type=float, default=2.5)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        state, steps = setup(a, pathlib.Path(tmp))
        out = measure(a, state, steps)
    med = {f: {k: statistics.median(v) for k, v in out[f].items()} for f in FORMS}
    print(f"GRPO step, d_model {a.d_model} x {a.layers} layers, {a.prompts} prompts x "
          f"{a.group} completions, <= {a.new} new tokens (end-of-text bias {a.eos_bias}), "
          f"1 inner step; medians of {a.steps} steps; {cpu_name()}")
    print(f"{'rollout':<10}{'rollout s':>11}{'update s':>10}{'step s':>10}{'mean len':>10}"
          f"{'longest':>9}")
    for f in FORMS:
        m = med[f]
        print(f"{f:<10}{m['rollout']:>11.4f}{m['update']:>10.4f}{m['step']:>10.4f}"
              f"{m['mean']:>10.1f}{m['longest']:>9.0f}")
    g, e = med["generate"], med["engine"]
    print(f"engine / generate: rollout {e['rollout'] / g['rollout']:.2f}x, "
          f"step {e['step'] / g['step']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
