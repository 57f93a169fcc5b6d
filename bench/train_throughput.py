"""Training throughput: tokens/s, achieved GFLOP/s and MFU of the jitted train step, and
(with torch and transformers installed) an HF GPT-2 of the same shape trained in PyTorch
in the same run, with the ratio.

    python bench/train_throughput.py [--layers 6 --d-model 384 --heads 6 --seq 256
        --batch 8 --vocab 256 --dtype float32 --steps 20] [model.key=value ...]

The peak behind MFU is measured in the same run with a large matmul on the same device.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxformer import ModelConfig, Transformer, count_params, flops_per_token
from jaxformer.config import PRESETS
from jaxformer.training.config import OptimConfig, parse_overrides
from jaxformer.training.metrics import measured_matmul_flops
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import init_state, make_train_step


def time_steps(step_fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_jax(cfg: ModelConfig, batch: int, seq: int, steps: int):
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    state = init_state(model, tx, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((batch, seq), np.float32)}
    step = make_train_step(model, tx, schedule)
    t0 = time.perf_counter()
    state, m = step(state, data)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    box = [state]

    def one():
        box[0], m = step(box[0], data)
        jax.block_until_ready(m)

    one()
    return compile_s, time_steps(one, steps)


def bench_torch(cfg: ModelConfig, batch: int, seq: int, steps: int):
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
        n_layer=cfg.n_layers, n_head=cfg.n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, activation_function="gelu_new"))
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))

    def one():
        opt.zero_grad(set_to_none=True)
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    t0 = time.perf_counter()
    one()
    first_s = time.perf_counter() - t0
    one()
    return first_s, time_steps(one, steps), torch.get_num_threads()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("overrides", nargs="*", help="model.key=value")
    a = p.parse_args()

    # GPT-2 shaped (learned positions, GELU, LayerNorm, biases, tied head) unless overridden
    base = dict(PRESETS["gpt2-small"])
    base.update(n_layers=a.layers, d_model=a.d_model, n_heads=a.heads, max_seq_len=a.seq,
                vocab_size=a.vocab, dtype=a.dtype)
    base.update(parse_overrides(a.overrides).get("model", {}))
    cfg = ModelConfig.from_dict(base)

    peak = measured_matmul_flops(2048 if jax.default_backend() != "cpu" else 1024,
                                 np.dtype(a.dtype) if a.dtype != "bfloat16" else jax.numpy.bfloat16)
    flops_tok = flops_per_token(cfg, a.seq)
    tokens = a.batch * a.seq
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  "
          f"measured matmul peak: {peak / 1e9:,.1f} GFLOP/s ({a.dtype})")
    print(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
          f"vocab {cfg.vocab_size}, seq {a.seq}, batch {a.batch}, {cfg.dtype}; "
          f"{count_params(cfg):,} params; {flops_tok / 1e6:.1f} MFLOP/token "
          f"(position={cfg.position}, scan_layers={cfg.scan_layers}, remat={cfg.remat}, "
          f"attention_impl={cfg.attention_impl})")

    rows = []
    c_s, step_s = bench_jax(cfg, a.batch, a.seq, a.steps)
    rows.append(("jaxformer (jit)", c_s, step_s))
    torch_res = None if a.no_torch else bench_torch(cfg, a.batch, a.seq, a.steps)
    if torch_res is not None:
        rows.append((f"HF GPT-2, PyTorch ({torch_res[2]} threads)", torch_res[0], torch_res[1]))

    header = (f"{'implementation':<34} {'first step s':>12} {'step ms':>9} {'tokens/s':>10} "
              f"{'GFLOP/s':>9} {'MFU':>7}")
    print(header)
    print("-" * len(header))
    for name, first_s, step_s in rows:
        tok_s = tokens / step_s
        print(f"{name:<34} {first_s:>12.2f} {step_s * 1e3:>9.1f} {tok_s:>10,.0f} "
              f"{tok_s * flops_tok / 1e9:>9.1f} {tok_s * flops_tok / peak:>7.1%}")
    if torch_res is not None:
        print(f"jaxformer / PyTorch tokens/s: {rows[1][2] / rows[0][2]:.2f}x")
    else:
        print("(PyTorch comparison skipped: torch and transformers not installed)")


if __name__ == "__main__":
    main()
