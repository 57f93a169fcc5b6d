"""Weights for inference in fewer bytes: bfloat16, or int8 weight-only with a float32
scale per output channel (symmetric absmax: kernel ~ round(kernel / s) * s, s = the
channel's max |w| / 127).

`quantize(params, "int8")` turns every projection kernel (attention q/k/v/out, the
feed-forward's, an untied lm_head) into a jaxformer.core.matmul.Int8Kernel, which the same
model reads as it is: each projection multiplies the int8 values converted to the compute
dtype and scales its output per channel. A mixture of experts' stacked kernels (EXPERTS:
wi_gate, wi_up, wo [E, in, out]) get a scale per expert and output channel [E, 1, out]
(jaxformer.moe.experts.expert_mlp reads them); its shared experts are a plain feed-forward's.
Embeddings, norms, biases, adapters and the routers' kernels (ROUTING: the router and
the shared experts' gate, whose rounding would move tokens between experts) keep their
dtype: an embedding is read one row per token, and the rest is small. "bfloat16" casts
the kernels and the token embedding (TOKEN_EMBEDDING); the rest, a learned position table
and the routers among them, keeps its dtype. The forward, generate, beam_search and
`python -m jaxformer.generate --weights int8` take either as they take float32 params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.matmul import Int8Kernel
from jaxformer.model.layer_runs import is_stacked

WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
CONTRACTED_AXES = {"out": 2}  # a kernel's input axes: the attention output reads heads x head_dim
EXPERTS = ("wi", "wi_gate", "wi_up", "wo")  # a mixture of experts' kernels: leaves, [E, in, out]
ROUTING = ("router", "shared_gate")  # kernels that choose experts: kept as they are
TOKEN_EMBEDDING = ("embed", "embedding")  # the token table's path (not pos_embed's)


def quantize_int8(w, contracted: int = 1, stacked: bool = False,
                  experts: bool = False) -> Int8Kernel:
    """w [(layers,) (experts,) in..., out...] (`contracted` input axes) as int8 values and
    a float32 scale per output channel [(layers,) (experts,) 1..., out...]: per layer and
    per expert too."""
    w = jnp.asarray(w, jnp.float32)
    lead = int(stacked) + int(experts)
    axes = tuple(range(lead, lead + contracted))
    scale = jnp.max(jnp.abs(w), axis=axes, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(w / scale), -127, 127)
    return Int8Kernel(values.astype(jnp.int8), scale)


def _kernel_of(names: list[str]) -> str | None:
    """The projection a param path's leaf is the kernel of (None: not a kernel, or an
    adapter's or a router's); an expert stack's leaf is its own name (EXPERTS)."""
    if any("lora" in n for n in names) or (len(names) > 1 and names[-2] in ROUTING):
        return None
    if names[-1] in EXPERTS:
        return names[-1]
    return names[-2] if names[-1] == "kernel" else None


def quantize(params, weights: str = "int8"):
    """params with their kernels (and, for bfloat16, the token embedding) in `weights`
    format: one of WEIGHT_FORMATS; float32 returns them as they are."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights == "float32":
        return params

    def convert(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        kernel = _kernel_of(names)
        if weights == "bfloat16":
            big = kernel is not None or tuple(names[-2:]) == TOKEN_EMBEDDING
            return x.astype(jnp.bfloat16) if big and jnp.issubdtype(x.dtype, jnp.floating) else x
        if kernel is None:
            return x
        return quantize_int8(x, CONTRACTED_AXES.get(kernel, 1), any(map(is_stacked, names)),
                             experts=names[-1] in EXPERTS)

    return jax.tree_util.tree_map_with_path(convert, params)


def dequantize(params, dtype=jnp.float32):
    """params with every Int8Kernel as a plain array of `dtype` (values * scale)."""
    return jax.tree.map(lambda x: x.dequantized(dtype) if isinstance(x, Int8Kernel) else x,
                        params, is_leaf=lambda x: isinstance(x, Int8Kernel))


def weight_bytes(params) -> int:
    """Bytes the params occupy (an Int8Kernel: its values and scales)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(params)))
