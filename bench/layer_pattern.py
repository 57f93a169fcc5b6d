"""Layer patterns at depth: compile time and step time of a Gemma-3-shaped model's loss and
gradient, scanned over layers and unrolled, against the same model with no pattern.

    python bench/layer_pattern.py [--depths 6,12,24 --d-model 256 --heads 4 --kv-heads 1
        --head-dim 64 --seq 512 --batch 1 --vocab 256 --window 128 --local 5 --steps 5
        --compiles 2 --variants plain/unscanned/auto,...] [model.key=value ...]

The model is Gemma 3's block at a small size: GeGLU, RMSNorm with the +1 offset, sandwich
norms, per-head q/k norm, GQA, a byte vocabulary, and a layer pattern of --local local
layers (sliding window --window, RoPE base 10k) to one global (every earlier key, RoPE
base 1M). "plain" is the same model with no pattern (every layer global, RoPE base 1M).
Scanned (scan_layers=true), each layer's kind travels through nn.scan as a traced id: the
window becomes data in the mask and the RoPE tables are stacked and indexed; unscanned, each
layer is its own code with its kind static. Scanned, compile time should not grow with
depth.

Each row jits jax.value_and_grad of the mean next-token cross entropy over model.apply and
times .lower() (tracing and lowering) and .compile() apart (the least of --compiles fresh
jits: a shared machine's noise only ever adds; "compile CPU s" is the process's CPU seconds
in .compile(), which another process's load on the cores hardly moves), then the compiled
step's median ms over --steps runs after a warm-up. "HLO lines": the compiled module's
text, a measure of the code size. Every row of one depth starts from the same params (the
scanned init, unstacked for the unrolled rows), so the loss column should agree between
scanned and unscanned rows of one pattern (and between the attention backends); plain and
pattern losses differ (the local layers see fewer keys). XLA runs at its default optimisation level
(whatever XLA_FLAGS says: leave the tests' -O0 out of it). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

VARIANTS = ("plain/unscanned/auto", "plain/scanned/auto", "pattern/unscanned/auto",
            "pattern/scanned/auto", "plain/scanned/blockwise", "pattern/scanned/blockwise")


def model_config(a, overrides, depth: int, pattern: bool, scanned: bool, impl: str):
    from jaxformer.training.config import RunConfig
    model = dict(vocab_size=a.vocab, d_model=a.d_model, n_layers=depth, n_heads=a.heads,
                 n_kv_heads=a.kv_heads, head_dim=a.head_dim, max_seq_len=a.seq,
                 position="rope", rope_theta=1e6, norm="rmsnorm_offset", norm_eps=1e-6,
                 block="sandwich", ffn="geglu", use_bias=False, qk_norm="head",
                 tie_embeddings=True, embed_multiplier=a.d_model ** 0.5, dtype=a.dtype,
                 scan_layers=scanned, attention_impl=impl)
    if pattern:
        model.update(layer_pattern=["local"] * a.local + ["global"],
                     layer_kinds={"local": {"window": a.window, "rope_theta": 10000.0},
                                  "global": {}})
    model.update(overrides.get("model", {}))
    return RunConfig.from_dict({"model": model,
                                "train": {"seq_len": a.seq, "batch_size": a.batch}}).model


def bench_row(cfg, params, data, steps: int, compiles: int):
    """(attention backend, lower s, compile s, compile CPU s (each the least of `compiles`
    fresh jits), median step ms, HLO lines, loss)."""
    import jax
    import jax.numpy as jnp

    from jaxformer import Transformer
    from jaxformer.attention.backends import dense_logits_bytes, resolve_impl
    from jaxformer.training.step import loss_sums

    model = Transformer(cfg)
    b, t = data["inputs"].shape
    impl = resolve_impl(cfg.attention_impl, cfg.dtype, cfg.head_dim, position=cfg.position,
                        logits_bytes=dense_logits_bytes(b, cfg.n_heads, t, t),
                        softcap=cfg.attn_softcap is not None)

    def loss(p, d):
        total, count = loss_sums(model, p, d)
        return total / jnp.maximum(count, 1.0)

    lower_s, compile_s, compile_cpu = [], [], []
    for _ in range(compiles):  # a fresh jit each time: nothing traced or compiled is reused
        fn = jax.jit(jax.value_and_grad(loss))
        t0 = time.perf_counter()
        lowered = fn.lower(params, data)
        t1, c1 = time.perf_counter(), time.process_time()
        compiled = lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        lower_s.append(t1 - t0)
        compile_s.append(t2 - t1)
        compile_cpu.append(c2 - c1)
    hlo_lines = compiled.as_text().count("\n")
    value, _ = jax.block_until_ready(compiled(params, data))  # warm-up
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        jax.block_until_ready(compiled(params, data))
        times.append((time.perf_counter() - s) * 1e3)
    return (impl, min(lower_s), min(compile_s), min(compile_cpu), statistics.median(times),
            hlo_lines, float(value))


def arguments(argv):
    """(the arguments, the variants as (pattern, scanned, attention_impl) triples)."""
    from jaxformer.attention.backends import AUTO, BACKENDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="6,12,24", help="comma-separated layer counts")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--window", type=int, default=128, help="the local layers' sliding window")
    p.add_argument("--local", type=int, default=5, help="local layers before each global one")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    p.add_argument("--compiles", type=int, default=2,
                   help="times each row is lowered and compiled afresh (the least is shown)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated pattern/scan/attention: plain|pattern, "
                        "scanned|unscanned, auto or a backend name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="model.key=value")
    a = p.parse_args(argv)
    variants = []
    impls = (AUTO, *BACKENDS)
    for v in (v.strip() for v in a.variants.split(",") if v.strip()):
        parts = v.split("/")
        if len(parts) != 3 or parts[0] not in ("plain", "pattern") or \
                parts[1] not in ("scanned", "unscanned") or parts[2] not in impls:
            p.error(f"variant {v!r} is not plain|pattern/scanned|unscanned/<attention>, "
                    f"attention one of {', '.join(impls)}")
        variants.append((parts[0] == "pattern", parts[1] == "scanned", parts[2]))
    return a, variants


def print_header(a, shape) -> None:
    """The device, the model's shape (`shape`: its config) and the table's head."""
    import jax
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()} "
          f"({jax.default_backend()}); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"jax {jax.__version__}")
    print(f"d_model {shape.d_model}, {shape.n_heads} heads ({shape.n_kv_heads} kv) x "
          f"head_dim {shape.head_dim}, d_ff {shape.d_ff} ({shape.ffn}), {shape.norm}, "
          f"block={shape.block}, qk_norm={shape.qk_norm}, vocab {shape.vocab_size}, "
          f"{shape.dtype}; batch {a.batch} x seq {a.seq}; pattern: {a.local} local "
          f"(window {a.window}, RoPE 10k) : 1 global (RoPE 1M); plain: every layer global "
          f"(RoPE 1M); step = value_and_grad of the loss (no optimizer), median of {a.steps}\n")
    print("| layers | params | pattern | layers run | attention | lower s | compile s | "
          "compile CPU s | step ms | HLO lines | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")


def depth_rows(a, overrides, depth: int, variants, tokens, data) -> None:
    """Print the table's rows of one depth, every variant from the same params."""
    import jax

    from jaxformer import count_params
    from jaxformer.attention.backends import AUTO
    from jaxformer.model.transformer import Transformer, unstack_layers

    init_cfg = model_config(a, overrides, depth, True, True, AUTO)
    stacked = jax.jit(Transformer(init_cfg).init)(jax.random.PRNGKey(a.seed),
                                                  tokens[:, :8])["params"]
    unrolled = unstack_layers(stacked)
    for pattern, scanned, impl in variants:
        cfg = model_config(a, overrides, depth, pattern, scanned, impl)
        shape = f"{f'{a.local}:1' if pattern else 'none'} | {'scan' if scanned else 'unrolled'}"
        try:  # counting the params traces the model: it may refuse the config too
            size = f"{count_params(cfg) / 1e6:.2f}M"
            used, lower_s, compile_s, cpu_s, step_ms, lines, loss = bench_row(
                cfg, stacked if scanned else unrolled, data, a.steps, a.compiles)
        except Exception as e:  # noqa: BLE001 -- a row's failure is reported, not fatal
            print(f"| {depth} | | {shape} | {impl} | failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]} | | | | | |", flush=True)
            continue
        print(f"| {depth} | {size} | {shape} | "
              f"{used if impl == AUTO else impl}{' (auto)' if impl == AUTO else ''} | "
              f"{lower_s:.2f} | {compile_s:.2f} | {cpu_s:.2f} | {step_ms:.1f} | {lines:,} | "
              f"{loss:.5f} |", flush=True)


def main(argv):
    a, variants = arguments(argv)

    import numpy as np

    from jaxformer.attention.backends import AUTO
    from jaxformer.training.config import parse_overrides

    overrides = parse_overrides(a.overrides)
    depths = [int(d) for d in a.depths.split(",") if d.strip()]
    tokens = np.random.default_rng(a.seed).integers(0, a.vocab, (a.batch, a.seq + 1), np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((a.batch, a.seq), np.float32)}
    print_header(a, model_config(a, overrides, depths[0], True, True, AUTO))
    for depth in depths:
        depth_rows(a, overrides, depth, variants, tokens, data)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
