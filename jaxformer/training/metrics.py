"""What a run reports: metrics.jsonl (+ TensorBoard when a writer is installed, + W&B with
train.wandb: training/tracking.py), the peak FLOP/s behind MFU, and the loss-curve plot."""

from __future__ import annotations

import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
PEAK_BF16_FLOPS = {
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10G": 125e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def measured_matmul_flops(n: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul on the default device: the best of `repeats` timed calls."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def peak_flops(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of all local devices, where the number comes from)."""
    device = jax.devices()[0]
    n = jax.local_device_count()
    if dtype == "bfloat16":
        for name, flops in PEAK_BF16_FLOPS.items():
            if name in device.device_kind:
                return flops * n, f"{device.device_kind} data sheet"
    flops = measured_matmul_flops(2048 if device.platform != "cpu" else 1024, jnp.dtype(dtype))
    return flops * n, f"measured {dtype} matmul on {device.device_kind}"


class MetricsLog:
    """Appends one JSON object per call to run_dir/metrics.jsonl; mirrors scalars to
    TensorBoard when tensorboardX is importable, and each record to `tracker` (a
    tracking.Tracker: W&B) when given."""

    def __init__(self, run_dir: pathlib.Path, enabled: bool = True, tracker=None):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.tracker = tracker
        self.tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard"))
            except ImportError:
                pass

    def write(self, record: dict):
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.finish()


def read_metrics(run_dir) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curve(run_dir, out_name: str = "loss.png") -> pathlib.Path:
    """Train and validation loss against step, from metrics.jsonl. Drawn on a Figure of its
    own (no pyplot, no matplotlib.use): a notebook's inline plots keep working after it."""
    from matplotlib.figure import Figure

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = pathlib.Path(run_dir) / out_name
    fig.savefig(out, dpi=110)
    return out
