"""The GPU suite: attention backends, the train step and decoding, measured in one command.

    python bench/gpu.py [--out DIR] [--smoke] [--sections attention,tests,train,decode]
        [--batch N] [--repeats N] [--masks causal,alibi,...] [--seqs 2048,8192]

1. attention: cuDNN vs XLA vs the reference in bf16 on every mask kind (causal, padding,
   packed, window, alibi, gqa): max error against the float32 reference, forward and
   forward+backward ms at T = 2,048 and 8,192, as the model calls it (is_causal + mask).
2. tests: tests/attention/'s cuDNN tests.
3. train: the jitted train step of gpt2-small (T 1,024) and configs/gpu_1b.yaml (T 2,048),
   bf16 compute, float32 params, scanned layers, remat none / dots / full, at the largest
   power-of-two batch the compiler says fits in 90% of device memory (or --batch):
   tokens/s, model TFLOP/s, MFU against the data-sheet bf16 peak and against a matmul
   measured in the same run, the step's memory (compiled) and compile seconds.
4. decode: generate() on the 1B config with bf16 params and cache at batch 1 and 64,
   against the memory roofline: (param bytes + KV cache bytes) read per step over a
   copy bandwidth measured in the same run.

Writes DIR/results.json and DIR/results.md (default DIR: bench/results/<device>) and
prints the tables. --smoke runs every section at tiny sizes on whatever backend is there
(CPU: seconds); a GPU-only part then says "skipped: no GPU". Asserts nothing. The
sections are separate so that a run can be split across shorter jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from attention import timed  # noqa: E402  (bench/attention.py: compile s, median s, bytes)

from jaxformer import ModelConfig, Transformer, count_params, flops_per_token  # noqa: E402
from jaxformer.attention import dot_product_attention, make_attention_mask  # noqa: E402
from jaxformer.decode import generate, kv_cache_bytes  # noqa: E402
from jaxformer.positions import alibi_bias, alibi_slopes, segment_positions  # noqa: E402
from jaxformer.training import load_config  # noqa: E402
from jaxformer.training.metrics import PEAK_BF16_FLOPS, measured_matmul_flops  # noqa: E402
from jaxformer.training.optim import OptimConfig  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.step import init_state, make_train_step  # noqa: E402

SECTIONS = ("attention", "tests", "train", "decode")
MASK_KINDS = ("causal", "padding", "packed", "window", "alibi", "gqa")
ATTENTION_IMPLS = ("cudnn", "xla", "reference")
NO_GPU = "skipped: no GPU"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs at: the real sizes, or --smoke's tiny ones."""
    attn_batch: int = 1
    attn_heads: int = 16
    attn_head_dim: int = 128
    attn_seqs: tuple = (2048, 8192)
    window: int = 1024
    matmul_n: int = 8192
    copy_bytes: int = 2 * GIB
    max_batch: int = 256
    steps: int = 10
    remats: tuple = ("none", "dots", "full")
    decode_batches: tuple = (1, 64)
    prompt: int = 128
    new_tokens: int = 256
    tiny: bool = False


SMOKE = Sizes(attn_batch=2, attn_heads=4, attn_head_dim=32, attn_seqs=(64,), window=16,
              matmul_n=256, copy_bytes=2**22, max_batch=2, steps=2, remats=("dots",),
              decode_batches=(1, 2), prompt=8, new_tokens=8, tiny=True)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def first_line(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"


# ---- the device -------------------------------------------------------------------

def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of x + 1 over a large float32 array: every byte read once and written once."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    _, seconds, _ = timed(lambda x: x + 1, x, repeats=repeats)
    return 2 * nbytes / seconds


def device_info(sizes: Sizes, repeats: int) -> dict:
    d = jax.devices()[0]
    sheet = next((f for name, f in PEAK_BF16_FLOPS.items() if name in d.device_kind), None)
    return {"backend": jax.default_backend(), "device_kind": d.device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "peak_bf16_flops_datasheet": sheet,
            "matmul_bf16_flops_measured": measured_matmul_flops(sizes.matmul_n, jnp.bfloat16,
                                                                repeats=repeats),
            "copy_bytes_per_s_measured": copy_bandwidth(sizes.copy_bytes, repeats)}


# ---- 1. attention backends --------------------------------------------------------

def attention_case(kind: str, sizes: Sizes, t: int, rng: np.random.Generator):
    """(q, k, v float32, kwargs) for one mask kind at length t, as the model calls it."""
    b, n, h = sizes.attn_batch, sizes.attn_heads, sizes.attn_head_dim
    kv = n // 4 if kind == "gqa" else n
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, heads, h), np.float32))
               for heads in (n, kv, kv))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = None
    if kind == "padding":  # each row real up to a random length, padding (0) after
        lengths = rng.integers(t // 2, t + 1, (b, 1))
        seg = jnp.asarray((np.arange(t) < lengths).astype(np.int32))
    if kind == "packed":  # documents of random lengths, positions restarting in each
        starts = np.zeros((b, t), np.int32)
        starts[:, rng.integers(1, t, 3 * t // 64 + 1)] = 1
        seg = jnp.asarray(1 + np.cumsum(starts, axis=1).astype(np.int32))
        pos = segment_positions(seg)
    arrays = {}  # mask and bias travel as arguments: closed over, XLA embeds them as constants
    if kind in ("padding", "packed", "window"):  # (4.3 GB of ALiBi bias at T 8,192)
        arrays["mask"] = make_attention_mask(pos, pos, seg, seg, causal=True,
                                             window=sizes.window if kind == "window" else None)
    if kind == "alibi":
        arrays["bias"] = alibi_bias(alibi_slopes(n), pos, pos)
    return q, k, v, arrays


def attend(q, k, v, arrays, impl):
    return dot_product_attention(q, k, v, impl=impl, is_causal=True, **arrays)


def attention_rows(sizes: Sizes, repeats: int, masks=MASK_KINDS) -> list[dict]:
    rng = np.random.default_rng()
    rows = []
    for t in sizes.attn_seqs:
        for kind in masks:
            q, k, v, arrays = attention_case(kind, sizes, t, rng)
            truth = jax.jit(attend, static_argnums=4)(q, k, v, arrays, "reference")
            qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
            for impl in ATTENTION_IMPLS:
                row = {"mask": kind, "seq": t, "impl": impl}
                rows.append(row)
                if impl == "cudnn" and not on_gpu():
                    row["status"] = NO_GPU
                    continue
                fwd = lambda q, k, v, arrays, impl=impl: attend(q, k, v, arrays, impl)  # noqa: E731
                grad = jax.grad(lambda q, k, v, arrays, fwd=fwd: jnp.sum(
                    fwd(q, k, v, arrays).astype(jnp.float32)), argnums=(0, 1, 2))
                try:
                    out = jax.jit(fwd)(qb, kb, vb, arrays)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - truth)))
                    _, fwd_s, _ = timed(fwd, qb, kb, vb, arrays, repeats=repeats)
                    _, bwd_s, _ = timed(grad, qb, kb, vb, arrays, repeats=repeats)
                except Exception as e:  # e.g. cuDNN refusing a shape, or out of memory
                    row["status"] = first_line(e)
                    continue
                row.update(status="ok", max_err=err, fwd_ms=fwd_s * 1e3,
                           fwd_bwd_ms=bwd_s * 1e3)
                print("attention row:", json.dumps(row), flush=True)
            del q, k, v, arrays, truth
    return rows


def cudnn_tests() -> dict:
    """tests/attention/'s cuDNN tests, run by pytest in a subprocess."""
    if not on_gpu():
        return {"status": NO_GPU}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/attention", "-k", "cudnn"]
    try:
        # this process holds most of the GPU's memory: the tests allocate as they go
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    except Exception as e:
        return {"status": first_line(e)}
    lines = (r.stdout + r.stderr).strip().splitlines()
    return {"status": "passed" if r.returncode == 0 else f"failed (exit {r.returncode})",
            "summary": lines[-1] if lines else ""}


# ---- 2. the train step ------------------------------------------------------------

def shrink(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at --smoke size."""
    kv = 2 if cfg.n_kv_heads < cfg.n_heads else 4
    return dataclasses.replace(cfg, vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                               n_kv_heads=kv, d_ff=128, max_seq_len=64)


def train_models(sizes: Sizes) -> list[tuple[str, ModelConfig, int]]:
    """(name, config, seq_len): gpt2-small and the 1B config, bf16 compute, scanned."""
    gpt2 = ModelConfig.preset("gpt2-small", vocab_size=50304)
    llama = load_config(str(REPO / "configs/gpu_1b.yaml")).model
    models = [("gpt2-small", gpt2, 1024), ("gpu_1b", llama, 2048)]
    out = []
    for name, cfg, seq in models:
        cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32",
                                  scan_layers=True)
        if sizes.tiny:
            cfg, seq = shrink(cfg), 32
        out.append((name, cfg, seq))
    return out


def step_bytes(compiled) -> int | None:
    """Arguments + temporaries + any output that does not alias a donated argument."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.temp_size_in_bytes + \
        max(0, m.output_size_in_bytes - m.alias_size_in_bytes)


def batch_of(cfg: ModelConfig, batch: int, seq: int):
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "loss_mask": jnp.ones((batch, seq), jnp.float32)}


def device_bytes_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def compile_step(step, state, cfg, batch: int, seq: int):
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_of(cfg, batch, seq)).compile()
    return compiled, time.perf_counter() - t0


def largest_batch(step, state, cfg, seq: int, sizes: Sizes):
    """(batch, compiled step, compile s): the largest power of two whose compiled step
    fits in 90% of device memory, predicted from batches 1 and 2 (memory is linear in
    the batch) and then checked; without a known limit (CPU), sizes.max_batch."""
    limit = device_bytes_limit()
    if limit is None:
        return (sizes.max_batch, *compile_step(step, state, cfg, sizes.max_batch, seq))
    one, _ = compile_step(step, state, cfg, 1, seq)
    two, _ = compile_step(step, state, cfg, 2, seq)
    per_row = max(1, step_bytes(two) - step_bytes(one))
    fits = max(1, int((0.9 * limit - step_bytes(one) + per_row) // per_row))
    batch = min(sizes.max_batch, 1 << (fits.bit_length() - 1))
    while True:
        compiled, seconds = compile_step(step, state, cfg, batch, seq)
        if batch == 1 or step_bytes(compiled) <= 0.9 * limit:
            return batch, compiled, seconds
        batch //= 2


def train_row(name, cfg, seq, remat, sizes: Sizes, fixed_batch, peaks) -> dict:
    cfg = dataclasses.replace(cfg, remat=remat)
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    step = make_train_step(model, tx, schedule)
    state = init_state(model, tx, 0)
    if fixed_batch:
        batch = fixed_batch
        compiled, compile_s = compile_step(step, state, cfg, batch, seq)
    else:
        batch, compiled, compile_s = largest_batch(step, state, cfg, seq, sizes)
    data = batch_of(cfg, batch, seq)
    for _ in range(2):  # warm up
        state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(sizes.steps):
        state, metrics = compiled(state, data)
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - t0) / sizes.steps
    tok_s = batch * seq / seconds
    flops = tok_s * flops_per_token(cfg, seq)
    stats = jax.devices()[0].memory_stats() or {}
    row = {"model": name, "params": count_params(cfg), "seq": seq, "remat": remat,
           "batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": tok_s,
           "model_tflops": flops / 1e12, "compile_s": compile_s,
           "step_gib_compiled": (step_bytes(compiled) or float("nan")) / GIB,
           "device_peak_gib_so_far": stats.get("peak_bytes_in_use", float("nan")) / GIB,
           "loss": float(metrics["loss"]) if "loss" in metrics else None}
    for key, peak in peaks.items():
        row[f"mfu_{key}"] = flops / peak if peak else None
    return row


def train_rows(sizes: Sizes, fixed_batch, peaks) -> list[dict]:
    rows = []
    for name, cfg, seq in train_models(sizes):
        for remat in sizes.remats:
            try:
                rows.append(train_row(name, cfg, seq, remat, sizes, fixed_batch, peaks))
            except Exception as e:
                rows.append({"model": name, "seq": seq, "remat": remat, "status": first_line(e)})
            print("train row:", json.dumps(rows[-1]), flush=True)  # kept if a later row times out
    return rows


# ---- 3. decoding ------------------------------------------------------------------

def decode_rows(sizes: Sizes, bandwidth: float, repeats: int) -> list[dict]:
    """generate() tokens/s on the 1B config, bf16 params and cache, against the roofline."""
    name, cfg, _ = train_models(sizes)[1]
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    model = Transformer(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    rows = []
    for batch in sizes.decode_batches:
        prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, sizes.prompt))

        def run(prompts=prompts):
            return generate(model, params, prompts, max_new_tokens=sizes.new_tokens,
                            rng=jax.random.key(0), temperature=0.0,
                            cache_dtype=jnp.bfloat16).tokens

        t0 = time.perf_counter()
        jax.block_until_ready(run())
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        tok_s = batch * sizes.new_tokens / seconds
        per_step = param_bytes + kv_cache_bytes(cfg, batch, sizes.prompt + sizes.new_tokens,
                                                jnp.bfloat16)
        roofline = batch * bandwidth / per_step
        rows.append({"model": name, "batch": batch, "prompt": sizes.prompt,
                     "new_tokens": sizes.new_tokens, "tokens_per_s": tok_s,
                     "compile_s": first - seconds, "bytes_per_step": per_step,
                     "roofline_tokens_per_s": roofline, "of_roofline": tok_s / roofline})
    return rows


# ---- the report -------------------------------------------------------------------

def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(title: str, header: list[str], rows: list[dict], cells: Callable) -> str:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for r in rows:
        if r.get("status", "ok") == "ok":
            lines.append("| " + " | ".join(cells(r)) + " |")
        else:
            keys = [str(r.get(k, "")) for k in ("mask", "model", "seq", "impl", "remat", "batch")
                    if k in r]
            lines.append("| " + " | ".join(keys) + " | " + r["status"] + " |")
    return "\n".join(lines) + "\n"


def markdown(res: dict) -> str:
    d = res["device"]
    out = [f"# bench/gpu.py{' --smoke' if res['smoke'] else ''}: {d['device_kind']} x"
           f"{d['device_count']} ({d['backend']}), jax {d['jax']}", "",
           f"- bf16 matmul, measured: {d['matmul_bf16_flops_measured'] / 1e12:,.2f} TFLOP/s; "
           f"data sheet: " + (f"{d['peak_bf16_flops_datasheet'] / 1e12:,.0f} TFLOP/s"
                              if d["peak_bf16_flops_datasheet"] else "unknown"),
           f"- copy bandwidth, measured: {d['copy_bytes_per_s_measured'] / 1e9:,.1f} GB/s", ""]
    if "attention" in res:
        out.append(table("Attention (bf16; error against the float32 reference)",
                         ["mask", "T", "impl", "max err", "fwd ms", "fwd+bwd ms"],
                         res["attention"], lambda r: [
                             r["mask"], str(r["seq"]), r["impl"], f"{r['max_err']:.2e}",
                             f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}"]))
    if "tests" in res:
        t = res["tests"]
        out.append(f"## cuDNN tests\n\n{t['status']}{': ' + t['summary'] if 'summary' in t else ''}\n")
    if "train" in res:
        out.append(table("Train step (bf16 compute, float32 params, scan)",
                         ["model", "T", "remat", "batch", "step ms", "tokens/s", "TFLOP/s",
                          "MFU (data sheet)", "MFU (measured matmul)", "step GiB (compiled)",
                          "compile s"],
                         res["train"], lambda r: [
                             r["model"], str(r["seq"]), r["remat"], str(r["batch"]),
                             f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                             f"{r['model_tflops']:.2f}", fmt(r["mfu_datasheet"], ".1%"),
                             fmt(r["mfu_measured"], ".1%"), f"{r['step_gib_compiled']:.2f}",
                             f"{r['compile_s']:.1f}"]))
    if "decode" in res:
        out.append(table("Decode (greedy, bf16 params and cache)",
                         ["model", "batch", "prompt + new", "tokens/s", "roofline tokens/s",
                          "of roofline", "compile s"],
                         res["decode"], lambda r: [
                             r["model"], str(r["batch"]), f"{r['prompt']} + {r['new_tokens']}",
                             f"{r['tokens_per_s']:,.0f}", f"{r['roofline_tokens_per_s']:,.0f}",
                             f"{r['of_roofline']:.1%}", f"{r['compile_s']:.1f}"]))
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any backend, seconds")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--batch", type=int, default=None, help="train batch (default: the largest "
                   "that fits)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--masks", default=",".join(MASK_KINDS), help="attention's mask kinds")
    p.add_argument("--seqs", default=None, help="attention's lengths, e.g. 8192")
    a = p.parse_args(argv)
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; sections are: {', '.join(SECTIONS)}")
    sizes = SMOKE if a.smoke else Sizes()
    masks = [m.strip() for m in a.masks.split(",") if m.strip()]
    if set(masks) - set(MASK_KINDS):
        p.error(f"unknown mask kind(s) in --masks; they are: {', '.join(MASK_KINDS)}")
    if a.seqs:
        sizes = dataclasses.replace(sizes, attn_seqs=tuple(int(t) for t in a.seqs.split(",")))
    repeats = a.repeats or (2 if a.smoke else 10)

    res = {"smoke": a.smoke, "device": device_info(sizes, repeats)}
    d = res["device"]
    peaks = {"datasheet": d["peak_bf16_flops_datasheet"],
             "measured": d["matmul_bf16_flops_measured"]}
    if "attention" in sections:
        res["attention"] = attention_rows(sizes, repeats, masks)
    if "tests" in sections:
        res["tests"] = cudnn_tests()
    if "train" in sections:
        res["train"] = train_rows(sizes, a.batch, peaks)
    if "decode" in sections:
        res["decode"] = decode_rows(sizes, d["copy_bytes_per_s_measured"], repeats)

    out = pathlib.Path(a.out or REPO / "bench" / "results" /
                       d["device_kind"].replace(" ", "_").replace("/", "_"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    print(f"written: {out / 'results.json'}, {out / 'results.md'}")
    return res


if __name__ == "__main__":
    main()
