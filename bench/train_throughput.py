"""Training throughput: the jitted train step against Hugging Face models of the same shape
trained in eager PyTorch, in the same run.

    python bench/train_throughput.py [--shapes gpt2,llama --layers 6 --d-model 384 --heads 6
        --kv-heads 2 --seq 256 --batch 8 --vocab 256 --dtype float32 --steps 10]
        [model.key=value ...]

Shapes: gpt2 (learned positions, LayerNorm, GELU, biases, tied head) against
GPT2LMHeadModel, and llama (RoPE, RMSNorm, SwiGLU, GQA with --kv-heads, untied head)
against LlamaForCausalLM. Each row splits the step into forward, backward and optimizer
milliseconds (medians; backward = value_and_grad - forward, optimizer = step -
value_and_grad on our side, timed phases on PyTorch's), with tokens/s and MFU against the
matmul peak measured in the same run. The two implementations take turns step by step, so
that a shared machine's drifting speed does not tilt their ratio. `model.key=value`
overrides are typed as train.py types them. Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxformer import Transformer, count_params, flops_per_token
from jaxformer.model.config import PRESETS
from jaxformer.training.config import RunConfig, parse_overrides
from jaxformer.training.metrics import measured_matmul_flops
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, loss_sums, make_train_step

SHAPES = {  # model fields of each shape beyond the command line's sizes
    "gpt2": dict(PRESETS["gpt2-small"]),
    "llama": dict(position="rope", norm="rmsnorm", block="pre_ln", ffn="swiglu",
                  use_bias=False, tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_jax(cfg, batch: int, seq: int, params=None):
    """(first step s, one()): one() times a forward, a forward+backward and a whole train
    step once each, in ms; from `params` where given (else a fresh init)."""
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    state = init_state(model, tx, 0)
    if params is not None:
        state = state.replace(params=params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((batch, seq), np.float32)}
    loss = lambda p: loss_sums(model, p, data)[0]  # noqa: E731
    fwd, fwd_bwd = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    step = make_train_step(model, tx, schedule)
    t0 = time.perf_counter()
    box = list(step(state, data))
    jax.block_until_ready(box)
    first_s = time.perf_counter() - t0

    def one_step():
        box[:] = step(box[0], data)
        jax.block_until_ready(box)

    params = lambda: box[0].params  # noqa: E731
    for f in (lambda: fwd(params()), lambda: fwd_bwd(params())):
        jax.block_until_ready(f())  # compile
    one_step()
    return first_s, lambda: (timed(lambda: jax.block_until_ready(fwd(params()))),
                             timed(lambda: jax.block_until_ready(fwd_bwd(params()))),
                             timed(one_step))


def hf_model(shape: str, cfg, seq: int):
    import transformers as T
    if shape == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=seq, n_embd=cfg.d_model,
            n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
            bos_token_id=0, eos_token_id=0))
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=seq,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=0, eos_token_id=0))


def bench_torch(shape: str, cfg, batch: int, seq: int, build=None):
    """(first step s, one(), threads), or None without torch and transformers: one() runs a
    train step and returns its forward, forward+backward and whole-step ms. build(): the
    HF model (default: hf_model's for the shape)."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return None
    torch.manual_seed(0)
    hf = build() if build is not None else hf_model(shape, cfg, seq)
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))

    def one():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = hf(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        t3 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3

    t0 = time.perf_counter()
    one()
    first_s = time.perf_counter() - t0
    one()
    return first_s, one, torch.get_num_threads()


def interleaved(runners, steps: int):
    """Medians of each runner's (fwd, fwd+bwd, step) ms over `steps` rounds, the runners
    taking turns within each round, so that a machine whose speed drifts (a shared host)
    slows them alike."""
    times = [[] for _ in runners]
    for _ in range(steps):
        for one, out in zip(runners, times):
            out.append(one())
    return [tuple(statistics.median(col) for col in zip(*out)) for out in times]


def model_config(shape: str, a, overrides):
    """The shape's ModelConfig at the command line's sizes, with the model.* overrides typed
    and checked as train.py does it."""
    model = dict(SHAPES[shape], n_layers=a.layers, d_model=a.d_model, n_heads=a.heads,
                 max_seq_len=a.seq, vocab_size=a.vocab, dtype=a.dtype)
    if shape == "llama":
        model["n_kv_heads"] = a.kv_heads
    model.update(overrides.get("model", {}))
    return RunConfig.from_dict({"model": model,
                                "train": {"seq_len": a.seq, "batch_size": a.batch}}).model


def print_table(rows, tokens: int, flops_tok: float, peak: float):
    header = (f"{'implementation':<36} {'first s':>8} {'fwd ms':>8} {'bwd ms':>8} "
              f"{'opt ms':>7} {'step ms':>8} {'bwd/fwd':>7} {'tokens/s':>9} {'MFU':>6}")
    print(header)
    print("-" * len(header))
    for name, first_s, fwd, fwd_bwd, step in rows:
        tok_s = tokens / (step / 1e3)
        print(f"{name:<36} {first_s:>8.2f} {fwd:>8.1f} {fwd_bwd - fwd:>8.1f} "
              f"{step - fwd_bwd:>7.1f} {step:>8.1f} {(fwd_bwd - fwd) / fwd:>7.2f} "
              f"{tok_s:>9,.0f} {tok_s * flops_tok / peak:>6.1%}")


def add_size_arguments(p: argparse.ArgumentParser):
    """The model and batch sizes, dtype and model.key=value overrides (model_config)."""
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2, help="llama shape only (GQA)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("overrides", nargs="*", help="model.key=value")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gpt2,llama", help="comma-separated: gpt2, llama")
    add_size_arguments(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args()
    overrides = parse_overrides(a.overrides)
    shapes = [s.strip() for s in a.shapes.split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; shapes are: {', '.join(SHAPES)}")

    dtype = jax.numpy.bfloat16 if a.dtype == "bfloat16" else np.dtype(a.dtype)
    peak = measured_matmul_flops(2048 if jax.default_backend() != "cpu" else 1024, dtype,
                                 repeats=20)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  measured matmul "
          f"peak: {peak / 1e9:,.1f} GFLOP/s ({a.dtype}); batch {a.batch} x seq {a.seq}\n")
    for shape in shapes:
        cfg = model_config(shape, a, overrides)
        flops_tok = flops_per_token(cfg, a.seq)
        print(f"[{shape}] {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
              f"({cfg.n_kv_heads} kv), d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, {cfg.dtype}; "
              f"{count_params(cfg):,} params; {flops_tok / 1e6:.1f} MFLOP/token "
              f"(position={cfg.position}, scan_layers={cfg.scan_layers}, remat={cfg.remat}, "
              f"attention_impl={cfg.attention_impl})")
        first_jax, one_jax = bench_jax(cfg, a.batch, a.seq)
        torch_res = None if a.no_torch else bench_torch(shape, cfg, a.batch, a.seq)
        runners = [one_jax] + ([torch_res[1]] if torch_res else [])
        medians = interleaved(runners, a.steps)
        rows = [("jaxformer (jit)", first_jax, *medians[0])]
        if torch_res is not None:
            hf_name = "GPT2LMHeadModel" if shape == "gpt2" else "LlamaForCausalLM"
            rows.append((f"HF {hf_name}, PyTorch ({torch_res[2]} thr)", torch_res[0],
                         *medians[1]))
        print_table(rows, a.batch * a.seq, flops_tok, peak)
        if torch_res is not None:
            print(f"jaxformer / PyTorch tokens/s: {rows[1][4] / rows[0][4]:.2f}x\n")
        else:
            print("(PyTorch comparison skipped: torch and transformers not installed)\n")


if __name__ == "__main__":
    main()
