"""GRPO on 2-digit addition: fine-tune a small model (d_model 64, 2 layers; a BPE of the
256 bytes and an end of text, so rollouts stop) on 4,000 "a+b=" -> "a + b" records until
its greedy exact match on 300 validation prompts reaches --target (default 50%: the
accuracy A), then run objective.name=grpo with objective.reward=task:addition from it
(256 prompts x 8 completions a step, 4 inner steps, lr 1e-4, 300 steps), and score both
on 500 held-out prompts.

    python -m jaxformer.experiments.grpo_addition --out runs/grpo_addition --seed 0 1 2

prints one JSON line per seed: sft_steps, sft_accuracy, grpo_accuracy, the gain in
points, and the run dirs (each holds its config.yaml: train.py with it makes the same
run; the fine-tune's is its last chunk's).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np

from jaxformer.data.tokenizer import train_bpe
from jaxformer.decode.loops import generate
from jaxformer.training.saved_run import load_run
from jaxformer.training import load_config, train
from jaxformer.training.rewards import addition

MODEL = ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.max_seq_len=32", "model.vocab_size=257"]
COMMON = ["train.seq_len=32", "train.log_every=10", "train.eval_batches=1",
          "train.sample_tokens=0", "train.progress=false", "data.val_fraction=0.05",
          "data.format=prompt_completion", "optim.warmup_steps=0"]


def records(count: int, rng: np.random.Generator) -> list[dict]:
    """`count` records "a+b=" -> "a + b", a and b uniform in 0..99."""
    return [{"prompt": f"{a}+{b}=", "completion": f"{a + b}"}
            for a, b in rng.integers(0, 100, (count, 2)).tolist()]


def accuracy(run_dir, prompts: list[str]) -> float:
    """Exact match of greedy completions (up to 5 new tokens) on `prompts`."""
    model, params, tok = load_run(str(run_dir))
    ids = [tok.encode(p) for p in prompts]
    width = max(len(i) for i in ids)
    batch = np.zeros((len(ids), width), np.int32)
    for r, i in enumerate(ids):
        batch[r, :len(i)] = i
    out = generate(model, params, batch, prompt_lengths=np.array([len(i) for i in ids]),
                   max_new_tokens=5, rng=jax.random.key(0), temperature=0.0, eos_id=tok.eot_id)
    tokens, lengths = jax.device_get((out.tokens, out.lengths))
    texts = [tok.decode([i for i in t[:n].tolist() if i != tok.eot_id])
             for t, n in zip(tokens, lengths)]
    return float(np.mean([addition(p, c) for p, c in zip(prompts, texts)]))


def fine_tune(out: pathlib.Path, base: list[str], seed: int, target: float, chunk: int,
              most: int, log) -> int:
    """Fine-tune (constant lr) in chunks of `chunk` steps, each resuming the last, until
    the greedy exact match on 300 validation prompts (not the test's) reaches `target`
    or `most` steps are done; returns the steps taken."""
    val = [r["prompt"] for r in records(300, np.random.default_rng(20_000 + seed))]
    steps = 0
    while steps < most:
        steps = min(steps + chunk, most)
        train(load_config(None, [*MODEL, *base, f"data.tokenizer={out / 'tokenizer.json'}",
                                 f"train.steps={steps}", "train.batch_size=32", "optim.lr=3e-3",
                                 "optim.schedule=constant", f"train.run_dir={out / 'sft'}"]),
              log=log)
        if accuracy(out / "sft", val) >= target:
            break
    return steps


def run_seed(out: pathlib.Path, seed: int, args, log) -> dict:
    """The SFT run (to args.target), the GRPO run from it, and both accuracies on 500
    held-out prompts."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data = out / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records(4000, rng)) + "\n")
    test = [r["prompt"] for r in records(500, np.random.default_rng(10_000 + seed))]
    base = [*COMMON, f"data.path={data}", f"data.cache_dir={out / 'cache'}",
            f"train.seed={seed}"]
    sft, grpo = out / "sft", out / "grpo"
    train_bpe(iter("0123456789+="), 257).save(out)  # the bytes and an end of text (id 0)
    sft_steps = fine_tune(out, base, seed, args.target, args.sft_chunk, args.sft_steps, log)
    train(load_config(None, [
        *base, "model.max_seq_len=32", f"train.init_from={sft}", "objective.name=grpo",
        "objective.reward=task:addition", "objective.group_size=8", "objective.beta=0",
        "objective.max_new_tokens=5", f"objective.inner_steps={args.inner}",
        f"train.batch_size={args.prompts}", f"train.steps={args.grpo_steps}",
        f"optim.lr={args.grpo_lr}", "optim.schedule=constant", "train.log_every=1",
        f"train.run_dir={grpo}"]), log=log)
    a, b = accuracy(sft, test), accuracy(grpo, test)
    return {"seed": seed, "sft_steps": sft_steps, "grpo_steps": args.grpo_steps,
            "sft_accuracy": a, "grpo_accuracy": b, "gain_points": 100 * (b - a),
            "sft_run": str(sft), "grpo_run": str(grpo)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--target", type=float, default=0.5,
                   help="fine-tune until the validation exact match reaches this")
    p.add_argument("--sft-chunk", type=int, default=100)
    p.add_argument("--sft-steps", type=int, default=3000, help="the most fine-tuning steps")
    p.add_argument("--grpo-steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=256, help="prompts per GRPO step")
    p.add_argument("--inner", type=int, default=4, help="objective.inner_steps")
    p.add_argument("--grpo-lr", type=float, default=1e-4)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    log = (lambda *a: None) if args.quiet else print
    for seed in args.seed:
        row = run_seed(pathlib.Path(args.out) / f"seed{seed}", seed, args, log)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
