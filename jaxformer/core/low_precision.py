"""Low-precision training matmuls: model.matmul_precision, a table (MATMUL_PRECISIONS) with
one entry per precision, each owning the 2-D dot a projection runs (jaxformer.core.matmul's
flat_dot_general hands it its flattened operands a [M, K] and b, a kernel [K, N] or a
table [N, K]) and the recipe for the experts' grouped matmuls.

- default: the dot in the model's compute dtype (model.dtype: float32 or bfloat16), as
  ever.
- float32: the operands in float32, at full precision (lax.Precision.HIGHEST: no TF32 or
  bfloat16 passes on a GPU or TPU), whatever model.dtype is.
- bf16: the operands rounded to bfloat16, the products summed in float32 (torch's
  autocast): model.dtype=float32 with bfloat16 matmuls.
- fp8: Transformer Engine's / torchtitan's float8 recipe with current ("tensorwise")
  scaling: each operand scaled by a per-tensor scale = format max / amax of the tensor,
  computed each step (no state), rounded to nearest even into float8_e4m3fn (activations
  and weights, forward) or float8_e5m2 (the incoming gradient, backward), saturated at
  the format's max; the dots take the float8 operands with float32 accumulation and the
  scales are divided out after. The backward reuses the forward's e4m3 operands: dx =
  g_e5m2 w_e4m3^T, dw = x_e4m3^T g_e5m2.
- fp8_rowwise: torchao's float8 "rowwise" recipe: every operand of every dot in
  float8_e4m3fn (the gradient too), scaled along that dot's contracted axis, so one scale
  per row of the activations and per output channel of the kernel in the forward, a
  scale rounded down to a power of two (applied and divided out exactly); the backward
  quantises each operand afresh along its own dot's contracted axis (the forward keeps
  a and b in float32): dx = g w^T with g per row and w per input channel, dw = x^T g with
  both per column (over the tokens). A token's outputs depend on that token alone.
- int8: AQT's symmetric per-channel int8 (MaxText's int8): activations scaled per row
  (token), weights per output channel, scale = 127 / amax, rounded to nearest even,
  clipped to [-127, 127]; int8 x int8 -> int32 dot, the scales divided out after. The
  backward is straight-through in float32: the quantiser's gradient is the identity (no
  clipping happens, as the scale maps amax to 127), and both gradient dots run in
  float32 with the other operand at its quantised value (dx = g deq(w)^T, dw = deq(x)^T
  g), as AQT with fwd_bits=8 and no backward bits.

The master weights stay in model.param_dtype (float32): each step quantises the kernel as
the projection reads it. Quantised: every projection of attention, the feed-forward
network, the recurrent mixers, and the routed experts. Not: the LM head (tied or not),
the router, LoRA's adapters and the MTP modules' projections stay in the model's dtype,
the standard choice (torchtitan and Transformer Engine keep the output layer and the
router in high precision). Int8Kernel weights (jaxformer.model.quantize, inference) keep
their own path. The experts' grouped matmuls run the same recipes on values on the grid
(quantised, divided by their scales) in float32: the same numbers up to float32 rounding,
not yet float8 operands inside ragged_dot. fp8 and int8 (grouped_recipe) reuse the
forward's operands in the gradient dots, as their 2-D dots do; fp8_rowwise
(rowwise_grouped) is torchao's float8 grouped matmul, each gradient dot quantising afresh
(the kernel gradient's operands per group and column, over that expert's rows). The
float32 entry's grouped product casts its operands only (the grouped matmuls take no
precision).

On a CPU the float8 dots run as simulated rounding (the numerics, not the speed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
INT8_MAX = 127.0
TINY = 1e-12  # an all-zero tensor's amax: its scale is finite, its values stay 0


def format_max(dtype) -> float:
    """The largest finite value of a quantised format (float8: 448 or 57344; int8: 127)."""
    return INT8_MAX if jnp.dtype(dtype) == jnp.int8 else float(jnp.finfo(dtype).max)


def to_grid(y, dtype):
    """y (float32) in dtype: saturated at the format's max, rounded to nearest even (the
    cast to float8 rounds so; jnp.round for int8)."""
    top = format_max(dtype)
    y = jnp.clip(y, -top, top)
    return (jnp.round(y) if jnp.dtype(dtype) == jnp.int8 else y).astype(dtype)


def quantise(x, dtype, axis=None, pow2=False):
    """x scaled into dtype's grid: (q, scale), x ~ q / scale. scale [float32, x's rank,
    size 1 on `axis` (None: every axis, one per tensor)] = format max / amax over axis
    (current scaling), with pow2 rounded down to a power of two (applied and divided out
    exactly; nothing saturates); q = to_grid(x scale)."""
    x = x.astype(jnp.float32)
    scale = lax.stop_gradient(scale_of(jnp.max(jnp.abs(x), axis=axis, keepdims=True), dtype,
                                       pow2))
    return to_grid(x * scale, dtype), scale


def scale_of(amax, dtype, pow2=False):
    """format max / amax (an all-zero amax: finite), with pow2 rounded down to a power of
    two: scale = m 2^e with m in [0.5, 1) gives 2^(e - 1), exactly."""
    scale = format_max(dtype) / jnp.maximum(amax, TINY)
    return jnp.ldexp(jnp.ones_like(scale), jnp.frexp(scale)[1] - 1) if pow2 else scale


def _dot(a, b, contract, out=jnp.float32):
    """a and b's 2-D product over the axes `contract` (a's, b's), accumulated in `out`."""
    return lax.dot_general(a, b, ((contract[0], contract[1]), ((), ())),
                           preferred_element_type=out)


def _backward_dots(qg, a, b, c, out=jnp.float32):
    """The gradient's two dots for a [M, K] and b ([K, N], c = 0, or [N, K], c = 1), g [M, N]:
    (dg a: [M, K], db: b's shape)."""
    da = _dot(qg, b, ((1,), (1 - c,)), out)  # [M, K]
    db = _dot(a, qg, ((0,), (0,)), out) if c == 0 else _dot(qg, a, ((0,), (0,)), out)
    return da, db


# ---- fp8: e4m3 forward, e5m2 gradients, per-tensor current scaling -------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_dot(a, b, c: int):
    """a [M, K] float32 times b (kernel [K, N], c = 0, or table [N, K], c = 1) -> [M, N]
    float32, by the fp8 recipe (module docstring)."""
    return _fp8_fwd(a, b, c)[0]


def _fp8_fwd(a, b, c):
    qa, sa = quantise(a, E4M3)
    qb, sb = quantise(b, E4M3)
    y = _dot(qa, qb, ((1,), (c,))) / (sa * sb)  # [M, N]
    return y, (qa, sa, qb, sb)


def _fp8_bwd(c, saved, g):
    qa, sa, qb, sb = saved
    qg, sg = quantise(g, E5M2)
    da, db = _backward_dots(qg, qa, qb, c)
    return da / (sg * sb), db / (sg * sa)


fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


# ---- fp8_rowwise: e4m3 throughout, a power-of-two scale per row or column of each dot --------


def _axiswise_dot(x, y, contract):
    """x and y (2-D) in e4m3, each scaled along its contracted axis (contract: x's, y's),
    so one scale per row of x and per column of y's side of the product [x's other axis,
    y's other axis]: their float32 product over the outer product of the scales."""
    qx, sx = quantise(x, E4M3, contract[0], pow2=True)
    qy, sy = quantise(y, E4M3, contract[1], pow2=True)
    return _dot(qx, qy, ((contract[0],), (contract[1],))) / (sx.reshape(-1, 1) * sy.reshape(1, -1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_rowwise_dot(a, b, c: int):
    """a [M, K] float32 times b (kernel [K, N], c = 0, or table [N, K], c = 1) -> [M, N]
    float32, by the fp8 rowwise recipe (module docstring)."""
    return _axiswise_dot(a, b, (1, c))


def _rowwise_bwd(c, saved, g):
    a, b = saved  # each dot quantises its operands afresh along its own contracted axis
    da = _axiswise_dot(g, b, (1, 1 - c))  # [M, K]: g per row, b per input channel
    db = _axiswise_dot(a, g, (0, 0)) if c == 0 else _axiswise_dot(g, a, (0, 0))  # over M
    return da, db


fp8_rowwise_dot.defvjp(lambda a, b, c: (_axiswise_dot(a, b, (1, c)), (a, b)), _rowwise_bwd)


# ---- int8: per-channel symmetric, int32 accumulation, straight-through float backward ------


def _int8_operands(a, b, c):
    """(qa, sa [M, 1]) per row of a, (qb, sb) per output channel of b, and sb as a row [1, N]."""
    qa, sa = quantise(a, jnp.int8, axis=1)
    qb, sb = quantise(b, jnp.int8, axis=c)  # [1, N] (c = 0) or [N, 1] (c = 1)
    return qa, sa, qb, sb, sb.reshape(1, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_dot(a, b, c: int):
    """a [M, K] float32 times b (kernel [K, N], c = 0, or table [N, K], c = 1) -> [M, N]
    float32, by the int8 recipe (module docstring)."""
    return _int8_fwd(a, b, c)[0]


def _int8_fwd(a, b, c):
    qa, sa, qb, sb, row = _int8_operands(a, b, c)
    y = _dot(qa, qb, ((1,), (c,)), jnp.int32).astype(jnp.float32) / (sa * row)  # [M, N]
    return y, (qa, sa, qb, sb)


def _int8_bwd(c, saved, g):
    qa, sa, qb, sb = saved
    return _backward_dots(g, qa.astype(jnp.float32) / sa, qb.astype(jnp.float32) / sb, c)


int8_dot.defvjp(_int8_fwd, _int8_bwd)


# ---- the experts' grouped matmuls: the same recipes, on values on the grid -------------------


def on_grid(x, dtype, axis, pow2=False):
    """x quantised (quantise) and back: float32 values on dtype's grid over their scales."""
    q, scale = quantise(x, dtype, axis, pow2)
    return q.astype(jnp.float32) / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def straight_through(x, dtype, axis):
    """on_grid(x) forward; its gradient passes through as it is (the straight-through
    estimator: the scale maps amax to the format's max, so nothing is clipped)."""
    return on_grid(x, dtype, axis)


straight_through.defvjp(lambda x, dtype, axis: (on_grid(x, dtype, axis), None),
                        lambda dtype, axis, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gradient_on_grid(y, dtype):
    """y forward; its incoming gradient put on dtype's grid (one scale per tensor)."""
    return y


gradient_on_grid.defvjp(lambda y, dtype: (y, None),
                        lambda dtype, _, g: (on_grid(g, dtype, None).astype(g.dtype),))


def grouped_recipe(operands, gradient=None, rows=None, channels=None):
    """A recipe for a bilinear product(h [..., in], kernel [G, in, out]) (an experts' grouped
    matmul, whatever its dispatch): both operands on the `operands` grid (h's scales over
    `rows`' axis, the kernel's over `channels`' axis; None: one per tensor), the product in
    float32 of those values, and the incoming gradient on the `gradient` grid (one scale
    per tensor; None: as it is). Its gradients are the product's own: straight through
    the quantisers, the backward reusing the forward's operands (fp8's and int8's 2-D dot
    recipes, up to float32 rounding of the values over scales)."""
    def product(matmul, h, kernel, row_groups, *args):  # each row's group: unused
        if jnp.issubdtype(kernel.dtype, jnp.integer):  # an Int8Kernel's values: its own path
            return matmul(h, kernel, *args)
        hq = straight_through(h.astype(jnp.float32), operands, rows)
        kq = straight_through(kernel.astype(jnp.float32), operands, channels)
        y = matmul(hq, kq, *args)  # [..., out] float32
        y = y if gradient is None else gradient_on_grid(y, gradient)
        return y.astype(h.dtype)
    return product


def cast_grouped(dtype):
    """product(h, kernel) with both operands cast to dtype, the result in h's dtype."""
    return lambda matmul, h, kernel, rows, *args: matmul(h.astype(dtype), kernel.astype(dtype),
                                                         *args).astype(h.dtype)


# ---- fp8_rowwise's grouped matmul: torchao's, each gradient dot quantised afresh ------------


def per_group_columns(x, rows, groups: int):
    """x [..., in] on the e4m3 grid (float32 values over their scales) with a power-of-two
    scale per group and column: each column's amax over its group's rows (rows [...]: each
    row's group of `groups`), torchao's per-group colwise scales of the kernel gradient."""
    flat, r = x.reshape(-1, x.shape[-1]).astype(jnp.float32), rows.reshape(-1)
    amax = jax.ops.segment_max(jnp.abs(flat), r, num_segments=groups)  # [G, in]
    scale = lax.stop_gradient(scale_of(amax, E4M3, pow2=True))[r]  # each row's group's
    return (to_grid(flat * scale, E4M3).astype(jnp.float32) / scale).reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rowwise_grouped(matmul, h, kernel, rows, *args):
    """matmul(h, kernel, *args) of h per row and the kernels per expert and output channel
    (their contracted axis), on the e4m3 grid with power-of-two scales."""
    return matmul(on_grid(h, E4M3, -1, True), on_grid(kernel, E4M3, -2, True), *args)


def _rowwise_grouped_bwd(matmul, saved, g):
    """dh = g k^T: g per row, the kernels per expert and input channel (both along out);
    dk = h^T g per group: h and g per group and column (along the group's rows)."""
    h, kernel, rows, args = saved
    dh = jax.vjp(lambda a: matmul(a, on_grid(kernel, E4M3, -1, True), *args), h)[1](
        on_grid(g, E4M3, -1, True))[0]
    groups = kernel.shape[0]
    hc, gc = per_group_columns(h, rows, groups), per_group_columns(g, rows, groups)
    dk = jax.vjp(lambda b: matmul(hc, b, *args), kernel)[1](gc)[0]
    return (dh, dk, None, *(None for _ in args))


_rowwise_grouped.defvjp(lambda matmul, h, kernel, rows, *args: (
    _rowwise_grouped(matmul, h, kernel, rows, *args), (h, kernel, rows, args)),
    _rowwise_grouped_bwd)


def rowwise_grouped(matmul, h, kernel, rows, *args):
    """fp8_rowwise's grouped product (torchao's _Float8GroupedMM): the forward as the 2-D
    dot's (h per row, the kernels per expert and output channel), the backward quantising
    afresh for each dot: dh's g per row and kernels per input channel, dk's h and g per
    group and column. rows: each row of h's group (expert). matmul closes over no traced
    array (the backward calls it again): what it reads beside h and kernel is args."""
    if jnp.issubdtype(kernel.dtype, jnp.integer):  # an Int8Kernel's values: its own path
        return matmul(h, kernel, *args)
    return _rowwise_grouped(matmul, h.astype(jnp.float32), kernel.astype(jnp.float32),
                            jnp.asarray(rows), *args).astype(h.dtype)


# ---- the table --------------------------------------------------------------------------------


def _result_type(a, b, preferred):
    return preferred or jnp.result_type(a.dtype, b.dtype)


def default_dot(a, b, c, precision=None, preferred_element_type=None):
    """The dot in the operands' dtype (the model's compute dtype), as ever."""
    return lax.dot_general(a, b, (((1,), (c,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)


def cast_dot(dtype, precision=None):
    """A dot with both operands cast to dtype, float32 accumulation, the result in the
    operands' own result type."""
    def dot(a, b, c, _precision=None, preferred_element_type=None):
        y = lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (c,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
        return y.astype(_result_type(a, b, preferred_element_type))
    return dot


def quantised_dot(recipe):
    """A dot by recipe (fp8_dot or int8_dot: float32 in and out), the result in the
    operands' own result type."""
    def dot(a, b, c, _precision=None, preferred_element_type=None):
        y = recipe(a.astype(jnp.float32), b.astype(jnp.float32), c)
        return y.astype(_result_type(a, b, preferred_element_type))
    return dot


@dataclasses.dataclass(frozen=True)
class MatmulPrecision:
    """One matmul precision: its 2-D dot (a [M, K], b, c: the contracted axis of b (0: a
    kernel [K, N], 1: a table [N, K]), precision, preferred_element_type) -> [M, N], and
    its grouped product (matmul, h [..., in], kernel [G, in, out], rows: each row's group,
    *args) -> matmul(h, kernel, *args) in that precision (the experts'; args: the arrays
    matmul reads beside h and kernel, e.g. the group sizes). batch_invariant: a row's
    (token's) outputs depend on that row alone (False: its scales span the batch, so the
    other rows move them)."""
    dot: Callable
    grouped: Callable
    about: str
    batch_invariant: bool = True


MATMUL_PRECISIONS = {
    "default": MatmulPrecision(default_dot, lambda matmul, h, kernel, rows, *args:
                               matmul(h, kernel, *args),
                               "the model's compute dtype (model.dtype)"),
    "float32": MatmulPrecision(cast_dot(jnp.float32, lax.Precision.HIGHEST),
                               cast_grouped(jnp.float32), "float32 operands at full precision"),
    "bf16": MatmulPrecision(cast_dot(jnp.bfloat16), cast_grouped(jnp.bfloat16),
                            "bfloat16 operands, float32 sums"),
    "fp8": MatmulPrecision(quantised_dot(fp8_dot), grouped_recipe(E4M3, E5M2),
                           "e4m3 forward, e5m2 gradients, per-tensor current scaling",
                           batch_invariant=False),
    "fp8_rowwise": MatmulPrecision(quantised_dot(fp8_rowwise_dot),
                                   rowwise_grouped,
                                   "e4m3 throughout, power-of-two scales per row and column"),
    "int8": MatmulPrecision(quantised_dot(int8_dot),
                            grouped_recipe(jnp.int8, rows=-1, channels=-2),
                            "per-channel int8, int32 sums, straight-through float backward"),
}
