"""Weight matmuls as plain 2-D dots: [tokens, features in] x [features in, features out].

A projection contracts the trailing axes of its input [B, T, ...] with the leading axes
of its kernel. Written as one dot_general over 3-D or 4-D arrays, its weight gradient
contracts the batch and sequence axes together, and XLA:CPU lowers that to a transpose
copy of an activation (with the elementwise work that produced it fused in) plus a dot
outside its fast matmul library: a jax.profiler trace of the bench step showed these
transposes at ~0.5 s of a ~2.5 s step. Flattened to 2-D first, every forward and
backward matmul is a library call on row-major operands, with no copy. The reshapes are
free (row-major bitcasts) and keep shardings: the merged axes are major-to-minor, so a
batch split over data/fsdp or heads split over tensor stays one contiguous block.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.linen import dtypes
from jax import lax

from jaxformer.core.low_precision import MATMUL_PRECISIONS, default_dot  # noqa: F401 (moe reads it)


class Int8Kernel(NamedTuple):
    """A kernel [in..., out...] held as int8 `values` and a float32 `scale` [1..., out...]
    (size 1 on the input axes), one per output channel: kernel = values * scale
    (jaxformer.model.quantize makes them; scanned layers add a leading layer axis to both). A
    projection reads it as it is and multiplies its output by the scale."""
    values: jax.Array
    scale: jax.Array

    def dequantized(self, dtype=jnp.float32):
        return self.values.astype(dtype) * self.scale.astype(dtype)


def promote_kernel(*args, dtype=None, inexact=True):
    """flax's promote_dtype for a projection's (inputs, kernel, bias), an Int8Kernel
    passed through as it is (flat_dot_general reads it), and a kernel of another dtype
    (bfloat16 weights, float32 compute) widened where it is used, not hoisted out of a
    decode loop."""
    inputs, kernel, *rest = args
    if dtype is not None and not isinstance(kernel, Int8Kernel) and \
            jnp.dtype(kernel.dtype).itemsize < jnp.dtype(dtype).itemsize:  # widened for the dot
        kernel, inputs = lax.optimization_barrier((kernel, inputs))  # see _int8_dot
    plain = [None if isinstance(x, Int8Kernel) else x for x in (inputs, kernel, *rest)]
    promoted = dtypes.promote_dtype(*plain, dtype=dtype, inexact=inexact)
    return [x if isinstance(x, Int8Kernel) else p
            for x, p in zip((inputs, kernel, *rest), promoted)]


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                     *, matmul=default_dot):
    """lax.dot_general for a projection, computed as a 2-D dot: the last k axes of lhs
    contracted with the first k of rhs (a kernel [in..., out...]) or its last k (a table
    [out..., in...], e.g. a tied embedding), no batch axes, by `matmul` (a
    jaxformer.core.low_precision.MatmulPrecision's dot). Anything else goes to
    lax.dot_general as given."""
    if isinstance(rhs, Int8Kernel):
        return _int8_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    (l_contract, r_contract), batch = dimension_numbers
    l_contract, r_contract = tuple(l_contract), tuple(r_contract)
    k = len(l_contract)
    kernel_first = r_contract == tuple(range(k))
    table_last = r_contract == tuple(range(rhs.ndim - k, rhs.ndim))
    if tuple(map(tuple, batch)) != ((), ()) or \
            l_contract != tuple(range(lhs.ndim - k, lhs.ndim)) or not (kernel_first or table_last):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
    rows, inner = lhs.shape[:lhs.ndim - k], math.prod(lhs.shape[lhs.ndim - k:])
    out = rhs.shape[k:] if kernel_first else rhs.shape[:rhs.ndim - k]
    rhs = rhs.reshape(inner, -1) if kernel_first else rhs.reshape(-1, inner)  # [in, out] | [out, in]
    y = matmul(lhs.reshape(math.prod(rows), inner), rhs, 0 if kernel_first else 1,
               precision, preferred_element_type)  # [M, out]
    return y.reshape(*rows, *out)  # [B, T, ...out]


@functools.cache
def projection_dot(matmul_precision: str = "default"):
    """flat_dot_general with the 2-D dot of model.matmul_precision (MATMUL_PRECISIONS): a
    projection's dot_general, one function per precision."""
    return functools.partial(flat_dot_general, matmul=MATMUL_PRECISIONS[matmul_precision].dot)


def _int8_dot(lhs, rhs: Int8Kernel, dimension_numbers, precision, preferred_element_type):
    """lhs times an Int8Kernel [in..., out...]: int8 values converted to lhs's dtype in the
    dot, the output scaled per channel after it (exact: a channel's scale is common to
    its whole column)."""
    k = len(tuple(dimension_numbers[0][1]))
    if tuple(dimension_numbers[0][1]) != tuple(range(k)) or rhs.scale.shape[:k] != (1,) * k:
        return flat_dot_general(lhs, rhs.dequantized(lhs.dtype), dimension_numbers, precision,
                                preferred_element_type)
    # tied to the input, so that XLA cannot hoist the conversion out of a decode loop (it
    # did: a float32 copy of every kernel, made once, read at float32 bandwidth)
    values, lhs = lax.optimization_barrier((rhs.values, lhs))
    y = flat_dot_general(lhs, values.astype(lhs.dtype), dimension_numbers, precision,
                         preferred_element_type)  # [..., out...]
    return y * rhs.scale.reshape(rhs.scale.shape[k:]).astype(y.dtype)
