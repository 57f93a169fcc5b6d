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

import math

from jax import lax


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """lax.dot_general for a projection, computed as a 2-D dot: the last k axes of lhs
    contracted with the first k of rhs (a kernel [in..., out...]) or its last k (a table
    [out..., in...], e.g. a tied embedding), no batch axes. Anything else goes to
    lax.dot_general as given."""
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
    y = lax.dot_general(lhs.reshape(math.prod(rows), inner), rhs,
                        (((1,), (0 if kernel_first else 1,)), ((), ())),
                        precision=precision, preferred_element_type=preferred_element_type)
    return y.reshape(*rows, *out)  # [B, T, ...out]
