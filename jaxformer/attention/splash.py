"""Splash attention: jax's TPU kernel (jax.experimental.pallas.ops.tpu.splash_attention),
handed the mask as structure: CausalMask or LocalMask for the window (without the causal
rule, an encoder's: FullMask, or LocalMask symmetric), SegmentIds for packing and padding;
GQA native, q pre-scaled.

Off a TPU it runs in Pallas interpret mode: slow, for tests (its error against a float32
reference is ~1e-6, forward and backward), with a one-line warning. Its masks are by
index, which is the model's rule whenever positions count up by one inside a segment
(jaxformer.positions.formulas.segment_positions, or arange). It takes no additive bias: ALiBi,
T5 and FIRE are refused by the config (use blockwise). A logit soft-cap is the kernel's
own attn_logits_soft_cap (applied to the pre-scaled q's logits: after the scale).
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxformer.attention.masks import MaskRule
from jaxformer.core.reference import check_softcap
from jaxformer.core.sharding import current_spec

BLOCK = 128  # the kernel's default block sizes: T is padded to a multiple inside
_WARNED: set = set()


def splash_attention(q, k, v, rule: MaskRule, *, scale=None, softcap=None):
    """q: [B, T, N, H]; k, v: [B, S, K, H] (N a multiple of K) -> [B, T, N, H].

    Self-attention with a causal rule or none (rule.causal and rule.is_causal both False:
    an encoder's, its window symmetric) (window optional, segment ids optional: id 0 is
    padding, and a padding query gets zeros, as on every other backend). Under
    jaxformer.core.sharding.sharding_context it runs per device under shard_map, rows split as
    act_batch says and heads as act_heads / act_kv_heads say (query heads stay whole
    where key/value heads cannot be split alike); the sequence must not be split.
    softcap: the logits s = q.k * scale become softcap * tanh(s / softcap)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError("splash attention here is self-attention (Tq = Tk)")
    causal = rule.causal or rule.is_causal
    if rule.layer_window is not None:
        raise NotImplementedError("splash attention needs each layer's window static, but the "
                                  "layer kinds' windows differ under scan_layers; set "
                                  "model.scan_layers=false or another attention_impl")
    if rule.any_chunk is not None:
        raise NotImplementedError("splash attention here has no chunked mask (a layer kind's "
                                  "chunk); use attention_impl=blockwise")
    interpret = jax.default_backend() != "tpu"
    if interpret and "interpret" not in _WARNED:
        _WARNED.add("interpret")
        print(f"attention: splash runs in Pallas interpret mode on {jax.default_backend()} "
              "(slow, for tests); use blockwise off TPUs", file=sys.stderr, flush=True)
    seg = rule.q_segment_ids if rule.q_segment_ids is not None else \
        jnp.ones(q.shape[:2], jnp.int32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    local = functools.partial(_splash, window=rule.window, causal=causal, scale=scale,
                              softcap=check_softcap(softcap), interpret=interpret)
    where = current_spec(q.shape, "act_batch", "act_seq", "act_heads", "head_dim")
    if where is None or where[0].size == 1:
        return local(q, k, v, seg)
    mesh, q_spec = where
    kv_spec = current_spec(k.shape, "act_batch", "act_seq", "act_kv_heads", "head_dim")[1]
    seq_axes = () if q_spec[1] is None else (q_spec[1],) if isinstance(q_spec[1], str) \
        else q_spec[1]
    if math.prod(mesh.shape[a] for a in seq_axes) > 1:
        raise NotImplementedError(f"splash attention with the sequence split over the mesh "
                                  f"(act_seq -> {q_spec[1]}) is not supported; use "
                                  "attention_impl=auto, which picks context parallel attention")
    q_spec, kv_spec = (P(x[0], None, *x[2:]) for x in (q_spec, kv_spec))  # a size-1 axis
    if q_spec[2] != kv_spec[2] and k.shape[2] > 1:  # a group's heads must share a device
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0])),
                         out_specs=q_spec, check_vma=False)(q, k, v, seg)


def _splash(q, k, v, seg, *, window, causal, scale, softcap, interpret):
    """The kernel on one device's rows and heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, n, h = q.shape
    tp = -(-t // BLOCK) * BLOCK
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, tp - t)))  # padded rows: id 0
    if window is None:
        base = sa.CausalMask((tp, tp)) if causal else sa.FullMask((tp, tp))
    else:
        base = sa.LocalMask((tp, tp), window_size=(window - 1, 0 if causal else window - 1),
                            offset=0)
    kernel = sa.make_splash_mha_single_device(sa.MultiHeadMask([base] * n),
                                              attn_logits_soft_cap=softcap,
                                              interpret=interpret)
    heads = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.vmap(kernel)(heads(q * jnp.asarray(scale, q.dtype)), heads(k), heads(v),
                           sa.SegmentIds(q=seg, kv=seg))
    out = out.transpose(0, 2, 1, 3)[:, :t]
    return jnp.where((seg[:, :t] != 0)[:, :, None, None], out, 0).astype(q.dtype)
