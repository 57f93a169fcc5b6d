"""Context parallelism: attention over a sequence split along a mesh axis (`context`).

ring_attention (inside shard_map; Liu et al. 2023, "Ring Attention"): each device keeps its
chunk of queries and passes its chunk of keys and values, with their positions and segment
ids, around the ring with ppermute. At each step it runs blockwise attention
(jaxformer.attention.blockwise) of its queries against the visiting chunk and merges the result by
log-sum-exp. Masks and position biases come from the global positions the chunk carries,
so causal, sliding-window, packed and padded batches and ALiBi / T5 / FIRE need nothing
special, and whatever the rule hides is skipped a block at a time (a step that sees nothing
costs its block tests). The backward (custom_vjp) sends the chunks around once more, each
with its dK / dV accumulators: every device adds its queries' share, computed from the
saved global row log-sum-exp (flash attention's backward splits exactly over key chunks),
and after a full circle each chunk's gradients are back on its device. K/V stay grouped
(GQA is never expanded). Memory per device: its own chunk, one visiting chunk and the
accumulators, whatever the number of devices.

gathered_attention: all-gather the keys and values (and their positions) over the axis,
then blockwise locally; its backward is the all-gather's transpose, a reduce-scatter. It
holds the whole sequence's K/V on every device, but runs one collective instead of N - 1.

zigzag_order: with a plain split, causal attention gives the last device N times the first
one's work; split into 2N chunks, device i holds chunks i and 2N - 1 - i, and every device
has the same work. Positions travel with the tokens, so the order of a row is free.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxformer.attention.blockwise import (_backward, _forward, blockwise_attention, heads_back,
                                           prepare, sink_grad)
from jaxformer.attention.masks import MaskRule
from jaxformer.core.reference import group_sinks


def zigzag_batch(batch, n: int):
    """A batch of [B, T] arrays (inputs, targets, loss_mask, positions, segment_ids) in
    zigzag order along T for n devices; positions are added (0..T-1) if absent, so that
    they travel with the tokens. The summed loss of a batch does not depend on the order."""
    t = batch["inputs"].shape[1]
    order = jnp.asarray(zigzag_order(t, n))
    if batch.get("positions") is None:
        batch = dict(batch, positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32),
                                                       batch["inputs"].shape))
    return {k: None if x is None else jnp.take(x, order, axis=1) for k, x in batch.items()}


def zigzag_order(t: int, n: int) -> np.ndarray:
    """The permutation of t positions that gives n devices equal causal work: index i of
    the reordered row is position order[i]; device d's contiguous share is chunks d and
    2n - 1 - d of 2n. t must be a multiple of 2n."""
    if t % (2 * n):
        raise ValueError(f"a zigzag split over {n} devices needs a length divisible by "
                         f"2 * {n} = {2 * n}, got {t}")
    chunks = np.arange(t).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * n - 1 - d]])
                           for d in range(n)])


def _rule_for(rule: MaskRule, kv) -> MaskRule:
    """The local queries' rule against a visiting chunk (its positions and segment ids)."""
    return rule.replace(k_positions=kv[2], k_segment_ids=kv[3])


def _visit(st, q, kv, rule, params):
    """Local queries against one chunk: out [B, K, G, Tq, H] float32 and the row
    log-sum-exp, -inf where the chunk holds no key a row may see."""
    out, res = _forward(st, q, kv[0], kv[1], _rule_for(rule, kv), params)
    lse = res[-1]
    return out, jnp.where(jnp.isposinf(lse), -jnp.inf, lse)


def _merge(out, lse, out_j, lse_j):
    """Two softmax-normalised partial results merged by their row log-sum-exps."""
    new = jnp.logaddexp(lse, lse_j)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    a, b = jnp.exp(lse - safe), jnp.exp(lse_j - safe)
    return out * a[..., None] + out_j * b[..., None], new


def _pass(x, axis: str, n: int):
    """x sent one device on around the ring (device d's to d + 1)."""
    return jax.lax.ppermute(x, axis, [(d, (d + 1) % n) for d in range(n)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(st, axis, n, q, kv, rule, params, sinks):
    return _ring_fwd(st, axis, n, q, kv, rule, params, sinks)[0]


def _ring_fwd(st, axis, n, q, kv, rule, params, sinks):
    out, lse = _visit(st, q, kv, rule, params)

    def step(_, carry):
        kv_j, out, lse = carry
        kv_j = _pass(kv_j, axis, n)
        return (kv_j, *_merge(out, lse, *_visit(st, q, kv_j, rule, params)))

    _, out, lse = jax.lax.fori_loop(1, n, step, (kv, out, lse))
    if sinks is not None:  # the sinks: one more partial result, a zero output at lse = sink
        out, lse = _merge(out, lse, jnp.zeros_like(out), jnp.broadcast_to(sinks[..., 0],
                                                                           lse.shape))
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # blockwise's convention: no key
    return out, (q, kv, rule, params, sinks, out, lse)


def _ring_bwd(st, axis, n, res, d_out):
    q, kv, rule, params, sinks, out, lse = res

    def grads(kv_j):  # this device's queries' share of the gradients against chunk kv_j
        dq, dk, dv, _, dp = _backward(st, (q, kv_j[0], kv_j[1], _rule_for(rule, kv_j),
                                           params, out, lse), d_out)
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32), dp

    dq, dk, dv, dp = grads(kv)

    def step(_, carry):
        kv_j, dkv, dq, dp = carry
        kv_j, dkv = _pass((kv_j, dkv), axis, n)
        dq_j, dk_j, dv_j, dp_j = grads(kv_j)
        return kv_j, (dkv[0] + dk_j, dkv[1] + dv_j), dq + dq_j, jax.tree.map(jnp.add, dp, dp_j)

    _, (dk, dv), dq, dp = jax.lax.fori_loop(1, n, step, (kv, (dk, dv), dq, dp))
    dk, dv = _pass((dk, dv), axis, n)  # the last step's chunk: one more hop brings it home
    none = jax.tree.map(lambda x: None, kv[2:])
    return (dq.astype(q.dtype), (dk.astype(kv[0].dtype), dv.astype(kv[1].dtype), *none),
            jax.tree.map(lambda x: None, rule), dp, sink_grad(sinks, out, lse, d_out))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, rule: MaskRule, *, axis: str, bias_fn=None, bias_params=None,
                   softcap=None, sinks=None, block_q=None, block_k=None):
    """Attention of this device's queries q [B, T, N, H] over the keys and values k, v
    [B, T, K, H] of every device on mesh axis `axis` (call it inside shard_map). rule:
    this device's positions and segment ids (global positions: the mask and the bias read
    them, so any order of the sequence over the devices works); index causality
    (is_causal) does not hold across devices and is dropped. bias_fn, bias_params,
    softcap, sinks as jaxformer.attention.blockwise.blockwise_attention. Returns [B, T, N, H]."""
    n = jax.lax.axis_size(axis)
    rule = rule.replace(is_causal=False, by_index=False)
    st, qh, kh, vh, rule = prepare(q, k, v, rule, bias_fn=bias_fn, block_q=block_q,
                                   block_k=block_k, softcap=softcap)
    kv = (kh, vh, rule.k_positions, rule.k_segment_ids)
    return heads_back(_ring(st, axis, n, qh, kv, rule, bias_params,
                            group_sinks(sinks, k.shape[2])), q)


def gathered_attention(q, k, v, rule: MaskRule, *, axis: str, bias_fn=None, bias_params=None,
                       softcap=None, sinks=None, block_q=None, block_k=None):
    """As ring_attention, by gathering every device's keys, values, positions and segment
    ids first (one all-gather each), then blockwise attention over the whole sequence."""
    gather = lambda x: None if x is None else jax.lax.all_gather(  # noqa: E731
        x, axis, axis=1, tiled=True)
    rule = rule.replace(k_positions=gather(rule.k_positions),
                        k_segment_ids=gather(rule.k_segment_ids), is_causal=False,
                        by_index=False)
    return blockwise_attention(q, gather(k), gather(v), rule, bias_fn=bias_fn,
                               bias_params=bias_params, softcap=softcap, sinks=sinks,
                               block_q=block_q, block_k=block_k)


def context_attention(q, k, v, rule: MaskRule, bias=None, *, split, gather: bool = False,
                      softcap=None, sinks=None):
    """Attention of global q [B, T, N, H] over k, v [B, T, K, H] with the sequence split
    as `split` says (jaxformer.core.sharding.sequence_split: the mesh, the sequence's axis, the
    rows' and the heads' axes, each used where it divides): shard_map of ring_attention,
    or of gathered_attention with `gather`. bias: a LogitBias or None (its params
    replicated, their gradient summed over the devices). sinks [N]: split as the heads."""
    mesh, axis, batch_axes, head_axes = split
    size = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))  # noqa: E731
    rows = tuple(a for a in batch_axes if mesh.shape[a] > 1)
    rows = rows if q.shape[0] % size(rows) == 0 else ()
    heads = tuple(a for a in head_axes if mesh.shape[a] > 1)
    # a bias is computed for every head, so with one the heads stay whole on each device
    heads = heads if bias is None and k.shape[2] % size(heads) == 0 else ()
    seq = P(rows or None, axis)
    heads_spec = P(rows or None, axis, heads or None, None)
    fn = gathered_attention if gather else ring_attention
    seg_spec = seq if rule.q_segment_ids is not None else None
    params = None if bias is None else bias.params

    def local(q, k, v, q_pos, k_pos, q_seg, k_seg, params, sinks):
        r = rule.replace(q_positions=q_pos, k_positions=k_pos, q_segment_ids=q_seg,
                         k_segment_ids=k_seg)
        return fn(q, k, v, r, axis=axis, bias_fn=None if bias is None else bias.fn,
                  bias_params=params, softcap=softcap, sinks=sinks)

    # checkpointed: differentiated inside a scan over layers, the shard_map's body is
    # linearised as a jaxpr, through the blockwise loops themselves (every block's logits
    # kept: 6 GiB a device at T 32k, context 8) instead of their custom VJP
    return jax.checkpoint(jax.shard_map(
        local, mesh=mesh,
        in_specs=(heads_spec, heads_spec, heads_spec, seq, seq, seg_spec, seg_spec,
                  jax.tree.map(lambda _: P(), params),
                  None if sinks is None else P(heads or None)),
        out_specs=heads_spec, check_vma=False),
        policy=jax.checkpoint_policies.nothing_saveable)(
        q, k, v, rule.q_positions, rule.k_positions, rule.q_segment_ids, rule.k_segment_ids,
        params, sinks)
