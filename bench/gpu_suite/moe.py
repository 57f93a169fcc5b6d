"""Section 8: a mixture-of-experts train step (bf16 compute, float32 params, scanned, remat
dots, dropless dispatch: sort + jaxformer.moe.grouped_matmul, ragged_dot on a GPU) at two
shapes that fit one GPU, T 2,048, batch sizes.moe_batch, vocab 32,768, Llama-style blocks:

- mixtral: d_model 2,048, 8 layers, 16 heads / 4 K/V heads, 8 experts of width 5,632,
  top-2, softmax over the chosen (Mixtral's router): 2.4B params, 0.70B active.
- qwen3_moe: Qwen3-30B-A3B's layer (d_model 2,048, 32 heads of 128 / 4 K/V heads, QK-norm,
  128 experts of width 768, top-8 renormalised) at 4 layers: 2.6B params, 0.29B active.

tokens/s and MFU on the ACTIVE parameters (flops_per_token: the router, the top_k experts a
token reaches; active_params = its matmul weights per token). Then every grouped matmul of
GROUPED_MATMULS (ragged_dot, tiles) on bf16 operands at each shape's expert kernel, rows
split unevenly over the experts (one expert empty), forward and both gradients against a
float64 NumPy reference of the same bf16 values: the max error relative to the largest
reference value. Last, jax.lax.ragged_dot's forward at the step's rows with bf16 and with
float8 e4m3 operands (operand_speeds): whether the device's compiled grouped matmul takes
float8 operands (or converts them first), how fast against bf16, and the error against
float64 of the same values (products exact, sums float32 on a CPU; a GPU's float8 matmul
may sum in less)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from gpu_suite.decoding import median_seconds
from gpu_suite.sizes import Sizes, first_line
from gpu_suite.train_step import train_row
from jaxformer import ModelConfig, flops_per_token
from jaxformer.moe.grouped_matmul import GROUPED_MATMULS
from op_profile import INSTRUCTION  # an HLO instruction: name, type, op, operands

LLAMA_LIKE = dict(vocab_size=32768, d_model=2048, n_heads=16, n_kv_heads=4, d_ff=5632,
                  max_seq_len=2048, position="rope", rope_theta=500000.0, norm="rmsnorm",
                  ffn="swiglu", use_bias=False, tie_embeddings=False, dtype="bfloat16",
                  param_dtype="float32", scan_layers=True)
MOE_SHAPES = {  # name: (model fields beyond LLAMA_LIKE, smoke's experts / top_k / width)
    "mixtral": (dict(n_layers=8, moe=dict(experts=8, top_k=2, d_ff=5632,
                                          router="topk_softmax")), (4, 2, 32)),
    "qwen3_moe": (dict(n_layers=4, n_heads=32, head_dim=128, qk_norm="head",
                       moe=dict(experts=128, top_k=8, d_ff=768, router="softmax_topk",
                                norm_topk=True)), (8, 4, 16)),
}
SMOKE_FIELDS = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                    max_seq_len=64)
SEQ, SMOKE_SEQ = 2048, 32


def moe_config(shape: str, sizes: Sizes) -> ModelConfig:
    """The shape's config; at --smoke, train_step.shrink's sizes with small experts."""
    fields, (experts, top_k, width) = MOE_SHAPES[shape]
    if sizes.tiny:
        fields = {**{k: v for k, v in fields.items() if k != "head_dim"}, **SMOKE_FIELDS,
                  "moe": {**fields["moe"], "experts": experts, "top_k": top_k, "d_ff": width}}
    return ModelConfig(**{**LLAMA_LIKE, **fields})


def active_params(cfg: ModelConfig) -> int:
    """The matmul weights one token runs through (flops_per_token with no attention / 6)."""
    return round(flops_per_token(cfg, 0) / 6)


def uneven_sizes(rows: int, groups: int, rng) -> np.ndarray:
    """[groups] int32 summing to rows, the first group empty, the rest random."""
    cuts = np.sort(rng.integers(0, rows + 1, groups - 2))
    return np.diff(np.concatenate([[0, 0], cuts, [rows]])).astype(np.int32)


def reference(x, w, g, sizes):
    """float64 (y = x_e w_e, dx = g_e w_e^T, dw_e = x_e^T g_e) per group e."""
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
    for e, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        y[lo:hi], dx[lo:hi], dw[e] = x[lo:hi] @ w[e], g[lo:hi] @ w[e].T, x[lo:hi].T @ g[lo:hi]
    return y, dx, dw


def operand_rows(cfg: ModelConfig, sizes: Sizes) -> int:
    """The rows the step's grouped matmuls take: batch x T x top_k (smoke: the check's)."""
    return sizes.moe_check_rows if sizes.tiny else sizes.moe_batch * SEQ * cfg.moe.top_k


def grouped_errors(cfg: ModelConfig, rows: int) -> dict:
    """{impl: max relative error of y, dx, dw} at cfg's expert kernel [E, d_model, width]."""
    rng = np.random.default_rng(0)
    e, d, f = cfg.moe.experts, cfg.d_model, cfg.expert_d_ff
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((rows, d), (e, d, f), (rows, f)))
    sizes = uneven_sizes(rows, e, rng)
    want = reference(*(np.asarray(a, np.float64) for a in (x, w, g)), sizes)
    out = {}
    for impl, matmul in GROUPED_MATMULS.items():
        y, vjp = jax.vjp(lambda x, w, m=matmul: m(x, w, jnp.asarray(sizes)), x, w)
        got = (y, *vjp(g))
        out[impl] = max(float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
                        for a, b in zip(got, want))
    return out


OPERAND_DTYPES = {"bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}  # ragged_dot's
MATMULS = ("dot", "ragged-dot", "custom-call")  # a dot (also in a fusion) or a library call
HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn"}


def ragged_forward(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def operands_reach_a_matmul(fn, args, dtype) -> bool:
    """Whether some matmul of fn's compiled HLO (a dot or a library call) takes an operand
    of dtype: false where the compiler converts the operands to another type before it.
    Operands are named in the text; each computation's names are looked up in it."""
    name = HLO_TYPES[jnp.dtype(dtype).name]
    types, found = {}, False
    for line in fn.lower(*args).compile().as_text().splitlines():
        if line and not line[0].isspace():  # a computation starts: its own names
            types = {}
        m = INSTRUCTION.match(line)
        if m:
            types[m.group(1)] = m.group(2)
            operands = [o.strip().lstrip("%") for o in m.group(4).split(",")]
            found |= m.group(3) in MATMULS and any(
                types.get(o, "").startswith(f"{name}[") for o in operands)
    return found


def operand_row(dtype, rows: int, check_rows: int, shape, repeats: int, rng) -> dict:
    """ragged_dot's forward on dtype operands: ms and TFLOP/s at `rows`, whether the
    compiled matmul takes dtype, and the max relative error against float64 of the same
    values at `check_rows`."""
    e, d, f = shape
    fn = jax.jit(ragged_forward)
    w = jnp.asarray(rng.standard_normal((e, d, f)) / np.sqrt(d), dtype)
    small = jnp.asarray(rng.standard_normal((check_rows, d)), dtype)
    small_sizes = uneven_sizes(check_rows, e, rng)
    y = np.asarray(fn(small, w, jnp.asarray(small_sizes)), np.float64)
    want = reference(np.asarray(small, np.float64), np.asarray(w, np.float64),
                     np.zeros((check_rows, f)), small_sizes)[0]
    x = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    sizes = jnp.asarray(uneven_sizes(rows, e, rng))
    _, seconds = median_seconds(lambda: fn(x, w, sizes), repeats)
    return {"ms": seconds * 1e3, "tflops": 2 * rows * d * f / seconds / 1e12,
            "in_matmul": operands_reach_a_matmul(fn, (x, w, sizes), dtype),
            "max_err": float(np.max(np.abs(y - want)) / np.max(np.abs(want)))}


def operand_speeds(cfg: ModelConfig, rows: int, check_rows: int, repeats: int) -> dict:
    """{operands: operand_row, or a failed one's first line} of jax.lax.ragged_dot (float32
    results) at cfg's expert kernel, in bf16 and in float8 e4m3: whether the device runs
    float8 operands in the grouped matmul (the compiled matmul takes them) and how fast
    (the fp8 recipe feeds ragged_dot dequantised values today)."""
    shape = (cfg.moe.experts, cfg.d_model, cfg.expert_d_ff)
    out = {}
    for name, dtype in OPERAND_DTYPES.items():
        try:
            out[name] = operand_row(dtype, rows, check_rows, shape, repeats,
                                    np.random.default_rng(1))
        except Exception as err:
            out[name] = {"status": first_line(err)}
    return out


def moe_rows(sizes: Sizes, fixed_batch, peaks, repeats: int = 2) -> list[dict]:
    """Per shape: the train step's row (train_step.train_row), active params, MFU on them,
    and the grouped matmuls' errors."""
    rows = []
    for shape in MOE_SHAPES:
        cfg, seq = moe_config(shape, sizes), SMOKE_SEQ if sizes.tiny else SEQ
        try:
            row = train_row(shape, cfg, seq, "dots", sizes, fixed_batch or sizes.moe_batch,
                            peaks)
            row.update(active_params=active_params(cfg), experts=cfg.moe.experts,
                       top_k=cfg.moe.top_k, expert_d_ff=cfg.expert_d_ff,
                       grouped_max_err=grouped_errors(cfg, sizes.moe_check_rows),
                       ragged_dot_operands=operand_speeds(cfg, operand_rows(cfg, sizes),
                                                          sizes.moe_check_rows, repeats),
                       backend=jax.default_backend())
            rows.append(row)
        except Exception as e:
            rows.append({"model": shape, "seq": seq, "status": first_line(e)})
        print("moe row:", json.dumps(rows[-1]), flush=True)
    return rows
