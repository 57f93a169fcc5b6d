"""Fine-tuning cost: full fine-tuning against LoRA, and a sweep of adapters in one vmapped
step against the same adapters trained one after another.

    python bench/finetune.py [--shapes gpt2,llama --seq 128 --batch 4 --steps 3
        --rank 8 --sweep 4]

Shapes: gpt2 (GPT-2 small: 124M, learned positions, tied head), llama (the same
width and depth with RoPE, RMSNorm, SwiGLU, 4 KV heads, a 32,000-token untied head) and
tiny (configs/tiny.yaml's 3M-param model).
For each: params trained, optimizer-state bytes, checkpoint bytes on disk (an orbax save
of the whole train state; for LoRA also the adapter-sized save train.py writes for a run
from train.init_from: adapters, scales and optimizer state, with the seconds the base's
sha256 took), the step's compile seconds and tokens/s (median step after the first) for
full fine-tuning and for LoRA on every projection.
Then --sweep adapters (seeds 0..n-1) as one vmapped step against one adapter's step
times n: both train n adapters on one batch each (--sweep 1: none). Prints tables;
asserts nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

from jaxformer import ModelConfig, Transformer
from jaxformer.model.config import PRESETS
from jaxformer.model.lora import partition
from jaxformer.training.adapter_checkpoint import AdapterCheckpointer, checksum
from jaxformer.training.checkpoint import Checkpointer
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step, trained_part

SHAPES = {
    "gpt2": dict(PRESETS["gpt2-small"], max_seq_len=1024, scan_layers=True),
    "llama": dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                  position="rope", norm="rmsnorm", ffn="swiglu", use_bias=False,
                  tie_embeddings=False, max_seq_len=1024, scan_layers=True),
    "tiny": dict(PRESETS["tiny"], scan_layers=True),  # configs/tiny.yaml's model: 3M
}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def measure(cfg: ModelConfig, batch: int, seq: int, steps: int, checkpoint: bool = True):
    """A row: trained params, optimizer bytes, checkpoint bytes, compile s, step s."""
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(warmup_steps=0), cfg, 1000)
    state = init_state(model, tx, 0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((batch, seq), np.float32)}
    step = make_train_step(model, tx, schedule)
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        state, m = compiled(state, data)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    ckpt_bytes = adapter_bytes = sha_s = None
    if checkpoint:
        ckpt_bytes = saved_bytes(Checkpointer, state, cfg)
    if checkpoint and cfg.lora.rank:
        t0 = time.perf_counter()
        record = {"base": {"init_from": "(bench)", "source": "(bench)",
                           "sha256": checksum(partition(state.params, scales=True)[2])}}
        sha_s = time.perf_counter() - t0

        def adapter_sized(path, **kwargs):
            ckpt = AdapterCheckpointer(path, "(bench)", load=None, **kwargs)
            ckpt.record = record
            return ckpt
        adapter_bytes = saved_bytes(adapter_sized, state, cfg)
    return dict(trained=sum(x.size for x in jax.tree.leaves(trained_part(state.params)[0])),
                params=sum(x.size for x in jax.tree.leaves(state.params)),
                opt=nbytes(state.opt_state), ckpt=ckpt_bytes, adapter_ckpt=adapter_bytes,
                sha_s=sha_s, compile=compile_s, step=statistics.median(times[1:]))


def saved_bytes(checkpointer, state, cfg) -> int:
    """Bytes on disk of one save of `state` by checkpointer(path, keep=, async_save=)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpointer(tmp, keep=1, async_save=False)
        ckpt.save(1, state, cfg)
        ckpt.wait()
        ckpt.close()
        return sum(p.stat().st_size for p in pathlib.Path(tmp).rglob("*") if p.is_file())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gpt2,llama")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--sweep", type=int, default=4)
    a = p.parse_args()
    tokens = a.batch * a.seq
    print(f"{jax.devices()[0].device_kind}, batch {a.batch} x seq {a.seq}, float32, "
          f"median of {a.steps} steps after the first, layers scanned\n", flush=True)
    print("| shape | training | params trained | optimizer state | checkpoint, full state | "
          "checkpoint, adapters only | base sha256 s | compile s | step s | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sweeps = []
    for shape in a.shapes.split(","):
        base = ModelConfig(**SHAPES[shape])
        lora = base.replace(lora={"rank": a.rank})
        for name, cfg in (("full", base), (f"LoRA r={a.rank}", lora)):
            r = measure(cfg, a.batch, a.seq, a.steps)
            adapters = "- | -" if r["adapter_ckpt"] is None else \
                f"{r['adapter_ckpt'] / 2**20:,.1f} MiB | {r['sha_s']:.2f}"
            print(f"| {shape} | {name} | {r['trained']:,} of {r['params']:,} | "
                  f"{r['opt'] / 2**20:,.1f} MiB | {r['ckpt'] / 2**20:,.1f} MiB | "
                  f"{adapters} | "
                  f"{r['compile']:.1f} | {r['step']:.2f} | {tokens / r['step']:,.0f} |",
                  flush=True)
            if cfg is lora:
                one = r
        if a.sweep > 1:
            sweep = measure(lora.replace(lora={"rank": a.rank, "sweep_seeds": a.sweep}),
                            a.batch, a.seq, a.steps, checkpoint=False)
            sweeps.append((shape, one, sweep))
    if not sweeps:
        return
    print(f"\n{a.sweep} LoRA adapters (r={a.rank}, seeds 0..{a.sweep - 1}), one batch each:\n")
    print("| shape | one after another (s) | one vmapped step (s) | speed-up | compile s (one, sweep) |")
    print("|---|---|---|---|---|")
    for shape, one, sweep in sweeps:
        seq_s = a.sweep * one["step"]
        print(f"| {shape} | {seq_s:.2f} ({a.sweep} x {one['step']:.2f}) | {sweep['step']:.2f} | "
              f"{seq_s / sweep['step']:.2f}x | {one['compile']:.1f}, {sweep['compile']:.1f} |")


if __name__ == "__main__":
    main()
