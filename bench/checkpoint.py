"""What checkpointing costs the step loop: configs/tiny.yaml trained with a save every
`--every` steps (asynchronous, then synchronous) against no saves, in the same run.

    python bench/checkpoint.py [--steps 40 --every 10 --repeats 2] [section.key=value ...]

Each row is one setting, its runs interleaved with the others'. Time per step is the loop's
own (metrics.jsonl, after the first 10 steps, which compile: evaluation excluded, saves
included), median over the repeats; the
overhead is against "no saves". Also: bytes per checkpoint, the milliseconds to verify
one (checksums) and to restore it, and how long one save call holds the loop (async: the
copy to host; sync: the whole write), which is the cost the step times are too noisy to
show. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import tempfile
import time

import jax

from jaxformer.training.saved_run import load_run_params
from jaxformer.model.transformer import Transformer
from jaxformer.training import load_config, train
from jaxformer.training.checkpoint import Checkpointer, damage
from jaxformer.training.metrics import read_metrics
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import init_state

REPO = pathlib.Path(__file__).resolve().parent.parent


def ms_per_step(run_dir) -> float:
    """The loop's wall time per step after the first logged window (which compiles):
    each window's steps / (tokens/s), summed."""
    cfg = load_config(str(pathlib.Path(run_dir) / "config.yaml"))
    tokens = cfg.train.batch_size * cfg.train.seq_len
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    steps = [b["step"] - a["step"] for a, b in zip(rows, rows[1:])]
    seconds = sum(n * tokens / r["tokens_per_s"] for n, r in zip(steps, rows[1:]))
    return seconds / sum(steps) * 1e3


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blocking_ms(cfg, async_save: bool, saves: int = 6) -> float:
    """Median time a save call holds the step loop (after the first, which compiles the
    host copy), each save starting with the previous one finished, as at checkpoint.every."""
    tx, _ = make_optimizer(cfg.optim, cfg.model, cfg.train.steps)
    state = init_state(Transformer(cfg.model), tx, 0)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, keep=2, async_save=async_save, log=lambda *a: None)
        for step in range(saves):
            ckpt.wait()
            t0 = time.perf_counter()
            ckpt.save(step, state, cfg.model)
            times.append(time.perf_counter() - t0)
        ckpt.close()
    return statistics.median(times[1:]) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    args, overrides = p.parse_known_args()
    settings = {"no saves": [f"checkpoint.every={10**9}"],
                f"every {args.every}, async": [f"checkpoint.every={args.every}"],
                f"every {args.every}, sync": [f"checkpoint.every={args.every}",
                                              "checkpoint.async_save=false"]}
    base = [f"train.steps={args.steps}", f"train.eval_every={10**9}", "train.sample_tokens=0",
            "train.progress=false", "train.log_every=10", *overrides]
    times = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (name, extra) in enumerate(settings.items()):
                run = pathlib.Path(tmp) / f"{rep}-{i}"
                train(load_config(str(REPO / "configs/tiny.yaml"),
                                  [*base, *extra, f"train.run_dir={run}"]), log=lambda *a: None)
                times[name].append(ms_per_step(run))
        step_dir = run / "checkpoints" / str(args.steps)
        size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
        t0 = time.perf_counter()
        assert damage(step_dir) is None
        verify_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        jax.block_until_ready(load_run_params(run))  # the whole state, as a resume reads it
        restore_ms = (time.perf_counter() - t0) * 1e3

    none = statistics.median(times["no saves"])
    print(f"configs/tiny.yaml, {args.steps} steps, {args.repeats} repeats; {cpu_name()}, "
          f"jax {jax.__version__}")
    print("| setting | ms / step (median) | runs | overhead |\n|---|---|---|---|")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"| {name} | {ms:.1f} | {', '.join(f'{t:.1f}' for t in ts)} | "
              f"{(ms / none - 1) * 100:+.1f}% |")
    print(f"\none checkpoint: {size / 2**20:.2f} MiB; verify (CRC-32 of every file) "
          f"{verify_ms:.1f} ms; verify + restore {restore_ms:.1f} ms")
    cfg = load_config(str(REPO / "configs/tiny.yaml"), list(overrides))
    print("a save holds the step loop for (median of 5): "
          f"{blocking_ms(cfg, True):.0f} ms async, {blocking_ms(cfg, False):.0f} ms sync")


if __name__ == "__main__":
    main()
