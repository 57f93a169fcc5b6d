"""Mixture-of-experts training and decoding: the jitted train step with dropless dispatch
(sort + jaxformer.moe.grouped_matmul: tiles on CPU, ragged_dot elsewhere), against the dense
reference dispatch (every expert on every token) and Hugging Face's eager PyTorch model of
the same shape, in the same run.

    python bench/moe.py [--shapes mixtral,qwen3_moe --layers 4 --d-model 512 --heads 8
        --kv-heads 2 --seq 256 --batch 8 --vocab 256 --steps 5 --no-torch --no-decode
        --layer-only] [model.key=value ...]

Shapes: mixtral (8 experts, top-2, softmax over the chosen, expert width 1408) against
MixtralForCausalLM, and qwen3_moe (32 experts, top-4 renormalised, width 352, QK-norm)
against Qwen3MoeForCausalLM: the same total expert parameters per layer. MFU counts the
active parameters (jaxformer.model.transformer.flops_per_token: the router, top_k
experts) against the matmul peak measured in the same run; "temp MiB" is the compiled
step's temporary buffers (XLA's memory analysis). The implementations take turns step by
step (bench/train_throughput.py's interleaving).

First, one MoE layer's forward and gradient against a dense FFN of the same active FLOPs
(layer_runs; --layer-only: that alone), with the layer's parts (its experts on rows
already sorted, its dispatch around identity experts) and the experts as one batched dot
at perfect balance (the matmuls' cost at this shape without a loop): wall and process CPU
time, interleaved (CPU time counts the work whatever else the host runs). Then greedy
KV-cached decoding at batch 1 and 8.
Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import bench_jax, bench_torch, interleaved, print_table, timed  # noqa: E402

from jaxformer import Transformer, count_params, flops_per_token  # noqa: E402
from jaxformer.decode import generate  # noqa: E402
from jaxformer.model.kinds import FFNS  # noqa: E402
from jaxformer.moe.experts import (GROUPED, expert_mlp, ragged_dispatch, route,  # noqa: E402
                                   take_rows)
from jaxformer.training.config import RunConfig, parse_overrides  # noqa: E402
from jaxformer.training.metrics import measured_matmul_flops  # noqa: E402
from jaxformer.training.optim import OptimConfig  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.step import abstract_state, make_train_step  # noqa: E402

LLAMA_LIKE = dict(position="rope", norm="rmsnorm", ffn="swiglu", use_bias=False,
                  tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6)
SHAPES = {  # model fields beyond the command line's sizes, and the HF class
    "mixtral": (dict(LLAMA_LIKE, moe=dict(experts=8, top_k=2, d_ff=1408,
                                          router="topk_softmax")), "Mixtral"),
    "qwen3_moe": (dict(LLAMA_LIKE, qk_norm="head", moe=dict(
        experts=32, top_k=4, d_ff=352, router="softmax_topk", norm_topk=True)), "Qwen3Moe"),
}


def model_config(shape: str, a, overrides, dispatch=None):
    model = dict(SHAPES[shape][0], n_layers=a.layers, d_model=a.d_model, n_heads=a.heads,
                 n_kv_heads=a.kv_heads, max_seq_len=a.seq + 64, vocab_size=a.vocab)
    model["moe"] = dict(model["moe"], dispatch=dispatch)
    extra = overrides.get("model", {})
    model.update({k: v for k, v in extra.items() if k != "moe"})
    model["moe"].update(extra.get("moe", {}))
    return RunConfig.from_dict({"model": model,
                                "train": {"seq_len": a.seq, "batch_size": a.batch}}).model


def hf_model(shape: str, cfg):
    import transformers as T
    m = cfg.moe
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                  num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=False, num_experts_per_tok=m.top_k,
                  router_aux_loss_coef=0.0, bos_token_id=0, eos_token_id=0)
    if shape == "mixtral":
        config = T.MixtralConfig(**common, num_local_experts=m.experts,
                                 intermediate_size=m.d_ff)
    else:
        config = T.Qwen3MoeConfig(**common, num_experts=m.experts, moe_intermediate_size=m.d_ff,
                                  intermediate_size=m.d_ff, norm_topk_prob=True,
                                  decoder_sparse_step=1)
    return getattr(T, f"{SHAPES[shape][1]}ForCausalLM")(config)


def temp_mib(cfg, batch: int, seq: int) -> float:
    """The compiled train step's temporary buffers, MiB."""
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    state = abstract_state(model, tx)
    data = {"inputs": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
            "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    compiled = make_train_step(model, tx, schedule).lower(state, data).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def layer_runs(cfg, tokens: int):
    """{name: (jitted gradient, its args)}: the forward and gradient (inputs and weights)
    of one MoE layer (router, dropless dispatch) on `tokens` rows and of its parts, and of
    a dense SwiGLU FFN of width top_k * expert width (the same active FLOPs, router aside).
    The parts: the experts alone on rows already sorted (the grouped matmuls and the
    activation), the dispatch alone (routing, sort, un-sort, weighted sum; the experts the
    identity), and the experts as one batched dot on exactly tokens * top_k / experts rows
    each ([E, C, D]: what the matmuls cost at perfect balance, no loop)."""
    m, d, f = cfg.moe, cfg.d_model, cfg.expert_d_ff
    r = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(r.standard_normal(s, np.float32) / np.sqrt(s[-2]))  # noqa
    x = jnp.asarray(r.standard_normal((tokens, d), np.float32))
    experts = {"wi_gate": w(m.experts, d, f), "wi_up": w(m.experts, d, f),
               "wo": w(m.experts, f, d)}
    router, ffn = w(d, m.experts), FFNS["swiglu"]
    dense_w = (w(d, m.top_k * f), w(d, m.top_k * f), w(m.top_k * f, d))
    _, chosen, _ = route(x @ router, m)
    order = jnp.argsort(chosen.reshape(-1), stable=True)
    rows = chosen.reshape(-1)[order]  # each sorted row's expert
    sizes = jnp.bincount(rows, length=m.experts).astype(jnp.int32)
    xs = x[order // m.top_k]  # [N k, D] sorted by expert

    def moe(x, p):  # [N, D] -> scalar
        weights, chosen, _ = route(x @ p[0], m)
        return jnp.sum(ragged_dispatch(x, weights, chosen, p[1], ffn)[0] ** 2)

    def experts_alone(xs, p, sizes):  # sizes an argument, as in the layer: not folded
        return jnp.sum(expert_mlp(xs, p, ffn, lambda h, k: GROUPED(h, k, sizes), rows) ** 2)

    def dispatch_alone(x, p):  # ragged_dispatch's steps around the experts
        weights, chosen, _ = route(x @ p[0], m)
        order = jnp.argsort(chosen.reshape(-1), stable=True)
        inverse = jnp.argsort(order)
        ys = take_rows(take_rows(x, order, inverse, m.top_k), inverse, order, 1)  # [N k, D]
        ys = ys.reshape(*chosen.shape, -1)  # [N, k, D]
        return jnp.sum(jnp.einsum("nkd,nk->nd", ys, weights) ** 2)

    def balanced(xb, p):  # xb [E, C, D]
        mm = lambda h, k: jnp.einsum("eci,eio->eco", h, k)  # noqa: E731
        return jnp.sum(expert_mlp(xb, p, ffn, mm) ** 2)

    def dense(x, p):
        return jnp.sum(((jax.nn.silu(x @ p[0]) * (x @ p[1])) @ p[2]) ** 2)

    grad = lambda fn: jax.jit(jax.grad(fn, argnums=(0, 1)))  # noqa: E731
    xb = xs.reshape(m.experts, -1, d)  # [E, N k / E, D]
    return {"MoE layer (dropless)": (grad(moe), (x, (router, experts))),
            "  its experts alone (rows sorted)": (grad(experts_alone), (xs, experts, sizes)),
            "  its dispatch alone": (grad(dispatch_alone), (x, (router, experts))),
            "experts as one batched dot, balanced": (grad(balanced), (xb, experts)),
            "dense FFN, same active FLOPs": (grad(dense), (x, dense_w))}


def layer_vs_dense(cfg, tokens: int, steps: int):
    """{name: (wall ms, CPU ms)} of layer_runs, medians of `steps` interleaved runs. The
    process's CPU time counts the work done whatever else the host runs."""
    runs = layer_runs(cfg, tokens)
    for fn, a in runs.values():
        jax.block_until_ready(fn(*a))
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, (fn, a) in runs.items():
            cpu = time.process_time()
            wall = timed(lambda: jax.block_until_ready(fn(*a)))  # noqa: B023
            times[name].append((wall, (time.process_time() - cpu) * 1e3))
    return {name: tuple(statistics.median(t[i] for t in ts) for i in (0, 1))
            for name, ts in times.items()}


def print_layer(times, tokens: int):
    """The layer_vs_dense table, each row also as a multiple of the dense FFN's."""
    dense = times["dense FFN, same active FLOPs"]
    print(f"| one layer, fwd + grad, {tokens} tokens | wall ms | x dense | CPU ms | x dense |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu) in times.items():
        print(f"| {name} | {wall:,.1f} | {wall / dense[0]:.2f} | {cpu:,.1f} | "
              f"{cpu / dense[1]:.2f} |")


def decode_rates(cfg, batches, prompt: int, new: int, repeats: int):
    """{batch: tokens/s} of greedy KV-cached generate (median of `repeats`)."""
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    out = {}
    for b in batches:
        prompts = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, prompt)))
        run = lambda: jax.block_until_ready(generate(  # noqa: E731
            model, params, prompts, max_new_tokens=new, rng=jax.random.key(1),
            temperature=0.0).tokens)
        run()
        out[b] = b * new / (statistics.median(timed(run) for _ in range(repeats)) / 1e3)
    return out


def parsed():
    """The command line's arguments and the shapes it names, checked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="mixtral,qwen3_moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-dense", action="store_true", help="skip the dense reference")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layer-only", action="store_true",
                   help="only the MoE layer against the dense FFN of the same active FLOPs")
    p.add_argument("overrides", nargs="*", help="model.key=value")
    a = p.parse_args()
    overrides = parse_overrides(a.overrides)
    shapes = [s.strip() for s in a.shapes.split(",")]
    if set(shapes) - set(SHAPES):
        p.error(f"unknown shape(s) {', '.join(set(shapes) - set(SHAPES))}; "
                f"shapes are: {', '.join(SHAPES)}")
    return a, overrides, shapes


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo, as lscpu's "Model name") and its count, or the
    device's kind."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]} x{len(names)}" if names else jax.devices()[0].device_kind


def main():
    a, overrides, shapes = parsed()
    peak = measured_matmul_flops(1024, np.dtype("float32"), repeats=20)
    print(f"device: {cpu_name()} ({jax.default_backend()})  measured matmul "
          f"peak: {peak / 1e9:,.1f} GFLOP/s (float32); batch {a.batch} x seq {a.seq}\n")
    for shape in shapes:
        cfg = model_config(shape, a, overrides)
        m, flops_tok = cfg.moe, flops_per_token(cfg, a.seq)
        print(f"[{shape}] {cfg.n_layers} layers, d_model {cfg.d_model}, {m.experts} experts "
              f"top-{m.top_k} of width {cfg.expert_d_ff}; {count_params(cfg):,} params; "
              f"{flops_tok / 6e6:.1f} M active matmul params/token (x6 = FLOPs)")
        print_layer(layer_vs_dense(cfg, a.batch * a.seq, max(a.steps, 5)), a.batch * a.seq)
        if a.layer_only:
            print()
            continue
        runs = [("jaxformer, ragged dispatch", cfg)]
        if not a.no_dense:
            runs.append(("jaxformer, dense reference", model_config(shape, a, overrides,
                                                                    "dense")))
        rows, runners = [], []
        for name, c in runs:
            first, one = bench_jax(c, a.batch, a.seq)
            rows.append([name, first])
            runners.append(one)
        torch_res = None if a.no_torch else bench_torch(shape, cfg, a.batch, a.seq,
                                                        build=lambda: hf_model(shape, cfg))
        if torch_res is not None:
            rows.append([f"HF {SHAPES[shape][1]}, PyTorch ({torch_res[2]} thr)", torch_res[0]])
            runners.append(torch_res[1])
        for row, med in zip(rows, interleaved(runners, a.steps)):
            row.extend(med)
        print_table([tuple(r) for r in rows], a.batch * a.seq, flops_tok, peak)
        for name, c in runs:
            print(f"{name}: compiled step temp {temp_mib(c, a.batch, a.seq):,.1f} MiB")
        if torch_res is not None:
            print(f"jaxformer ragged / PyTorch tokens/s: {rows[-1][4] / rows[0][4]:.2f}x")
        if not a.no_decode:
            rates = decode_rates(cfg, (1, 8), 16, a.new_tokens, 3)
            print("greedy decode (prompt 16, +%d): " % a.new_tokens +
                  ", ".join(f"batch {b} {r:,.0f} tokens/s" for b, r in rates.items()))
        print()


if __name__ == "__main__":
    main()
