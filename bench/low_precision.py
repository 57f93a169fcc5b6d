"""Low-precision training matmuls (model.matmul_precision) against bf16, by training: the
same model, data and seed for --steps steps in each precision, through train.py's loop
(configs/tiny.yaml's 3M-param byte-level model on the Python standard library's source,
model.dtype=bfloat16, the same batches in the same order).

    python bench/low_precision.py [--steps 200 --precisions default,fp8,fp8_rowwise,int8 --batch 16
        --seq 128 --lr 3e-3 --seed 0]

`default` is plain bf16 training (the dots in the compute dtype, bfloat16). On a CPU the
float8 and int8 dots run as simulated rounding: the losses are what a GPU or TPU would
reach, the seconds are not its speed (bench/gpu.py measures that). Prints a table: each
precision's train loss (the mean over the last 10% of steps), its validation loss at the
end, both relative to the first precision's, and seconds per step. Asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import re
import tempfile
import time

import numpy as np

from jaxformer.training import load_config, train
from jaxformer.training.metrics import read_metrics


def run(precision: str, args, run_dir: pathlib.Path) -> dict:
    """One training run; its final train and validation losses and seconds per step."""
    overrides = [f"model.matmul_precision={precision}", "model.dtype=bfloat16",
                 f"train.steps={args.steps}", f"train.batch_size={args.batch}",
                 f"train.seq_len={args.seq}", f"optim.lr={args.lr}", "train.log_every=1",
                 f"train.eval_every={args.steps}", f"checkpoint.every={args.steps}",
                 f"train.run_dir={run_dir}", "train.sample_tokens=0", f"train.seed={args.seed}"]
    start = time.perf_counter()
    summary = train(load_config("configs/tiny.yaml", overrides), log=lambda *a, **k: None)
    seconds = time.perf_counter() - start
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    tail = max(1, len(losses) // 10)
    return dict(train=float(np.mean(losses[-tail:])), val=summary.get("val_loss"),
                s_per_step=seconds / args.steps)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's machine."""
    try:
        found = re.search(r"model name\s*:\s*(.+)", pathlib.Path("/proc/cpuinfo").read_text())
    except OSError:
        found = None
    return found.group(1).strip() if found else platform.machine()


def table(rows: dict[str, dict]) -> str:
    first = next(iter(rows.values()))
    lines = ["| precision | train loss | vs first | val loss | vs first | s/step |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        val = "-" if r["val"] is None else f"{r['val']:.4f}"
        rel_val = "-" if r["val"] is None else f"{r['val'] / first['val'] - 1:+.2%}"
        lines.append(f"| {name} | {r['train']:.4f} | {r['train'] / first['train'] - 1:+.2%} | "
                     f"{val} | {rel_val} | {r['s_per_step']:.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--precisions", default="default,fp8,fp8_rowwise,int8")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)  # train.seed: the init and the batches
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.precisions.split(","):
            rows[name] = run(name, args, pathlib.Path(tmp) / name)
            print(f"{name}: {rows[name]}", flush=True)
    print(f"\n{args.steps} steps, batch {args.batch} x {args.seq} bytes, model.dtype=bfloat16, "
          f"seed {args.seed}, on {cpu_name()}")
    print(table(rows))


if __name__ == "__main__":
    main()
