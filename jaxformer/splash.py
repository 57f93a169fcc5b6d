"""Splash attention: jax's TPU kernel (jax.experimental.pallas.ops.tpu.splash_attention),
handed the mask as structure: CausalMask or LocalMask for the window, SegmentIds for
packing and padding; GQA native, q pre-scaled.

Off a TPU it runs in Pallas interpret mode: slow, for tests (its error against a float32
reference is ~1e-6, forward and backward), with a one-line warning. Its masks are by
index, which is the model's rule whenever positions count up by one inside a segment
(jaxformer.positions.segment_positions, or arange). It takes no additive bias: ALiBi,
T5 and FIRE are refused by the config (use blockwise).
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp

from jaxformer.masks import MaskRule
from jaxformer.sharding import _MESH

BLOCK = 128  # the kernel's default block sizes: T is padded to a multiple inside
_WARNED: set = set()


def splash_attention(q, k, v, rule: MaskRule, *, scale=None):
    """q: [B, T, N, H]; k, v: [B, S, K, H] (N a multiple of K) -> [B, T, N, H].

    Self-attention with a causal rule (window optional, segment ids optional: id 0 is
    padding, and a padding query gets zeros, as on every other backend)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mesh = _MESH.get()
    if mesh is not None and mesh.size > 1:
        raise NotImplementedError("attention_impl='splash' runs on one device so far (no "
                                  "shard_map over the mesh yet); use 'blockwise' on a mesh")
    if not rule.causal or q.shape[1] != k.shape[1]:
        raise ValueError("splash attention here is causal self-attention (Tq = Tk)")
    interpret = jax.default_backend() != "tpu"
    if interpret and "interpret" not in _WARNED:
        _WARNED.add("interpret")
        print(f"attention: splash runs in Pallas interpret mode on {jax.default_backend()} "
              "(slow, for tests); use blockwise off TPUs", file=sys.stderr, flush=True)
    b, t, n, h = q.shape
    tp = -(-t // BLOCK) * BLOCK
    seg = rule.q_segment_ids if rule.q_segment_ids is not None else jnp.ones((b, t), jnp.int32)
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, tp - t)))  # padded rows: id 0
    base = sa.CausalMask((tp, tp)) if rule.window is None else \
        sa.LocalMask((tp, tp), window_size=(rule.window - 1, 0), offset=0)
    kernel = sa.make_splash_mha_single_device(sa.MultiHeadMask([base] * n),
                                              interpret=interpret)
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    heads = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.vmap(kernel)(heads(q * jnp.asarray(scale, q.dtype)), heads(k), heads(v),
                           sa.SegmentIds(q=seg, kv=seg))
    out = out.transpose(0, 2, 1, 3)[:, :t]
    return jnp.where((seg[:, :t] != 0)[:, :, None, None], out, 0).astype(q.dtype)
