"""Expert parallelism: a mixture's experts split over the mesh's `expert` axis, each
token sent to its experts' devices and back by all-to-all under jax.shard_map.

With mesh.expert = X and E experts, device r of the expert axis holds experts
[r E/X, (r+1) E/X) whole (their embed axis split over fsdp and gathered for the matmul:
only this device's experts, never another's; their hidden axis split over tensor, the
partial sums reduced). Tokens are split over data x fsdp x expert (x context), so every
device routes its own tokens. Per device, with n tokens and top-k:

  sort the n k assignments by expert (so by destination device, then local expert)
  send buffer [X, C, D]: row j holds the rows bound for device j, C = n min(k, E/X) the
    most one device can send another (a token reaches an expert once): dropless
  all_to_all over `expert`: receive [X, C, D] (row i: from device i), and each sender's
    per-expert counts [X, E/X], which give every received row its local expert
  moe.ragged_dispatch on the received rows (each row its local expert, weight 1): the
    local experts by jax.lax.ragged_dot, back in received order (padding rows: zeros)
  all_to_all back; each assignment reads its result where it sent its row, un-sorted
    to token order and summed with its weights as moe.ragged_dispatch does

jax.lax.ragged_all_to_all would send only the real rows, but XLA:CPU has no
ragged-all-to-all (jax 0.10.2: "HLO opcode ragged-all-to-all is not supported by XLA:CPU
ThunkEmitter"), so the exchange is a fixed-size all_to_all of the worst case. The
shard_map is manual over every mesh axis: the sort, the scatter into the send buffer and
the grouped matmul are per-device work that a compiler-partitioned (auto) token axis
would gather instead.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxformer.core.sharding import check_expert_split, current_spec, expert_mesh
from jaxformer.moe.experts import DISPATCHES, ragged_dispatch

AXIS = "expert"

# an expert param's logical axes (leading: the experts); {name}_bias: (experts, its out)
EXPERT_AXES = {
    "wi_gate": ("experts", "embed", "expert_mlp"),
    "wi_up": ("experts", "embed", "expert_mlp"),
    "wi": ("experts", "embed", "expert_mlp"),
    "wo": ("experts", "expert_mlp", "embed"),
}


def param_axes(name: str) -> tuple[str, ...]:
    """The logical axes of the expert param `name` (EXPERT_AXES, or a kernel's bias)."""
    if name in EXPERT_AXES:
        return EXPERT_AXES[name]
    if name.endswith("_bias") and name[:-5] in EXPERT_AXES:
        return ("experts", EXPERT_AXES[name[:-5]][-1])
    raise ValueError(f"expert parallelism: no logical axes for the expert param {name!r}; "
                     "add its row to jaxformer.moe.expert_parallel.EXPERT_AXES")


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def token_axes(n: int, mesh) -> tuple[str, ...]:
    """The mesh axes n tokens (rows of a [B, T] batch, flattened) are split over: those of
    act_batch then act_seq, size > 1, each kept while the product divides n."""
    rules = dict(nn.get_logical_axis_rules())
    kept = ()
    for a in _axes(rules.get("act_batch")) + _axes(rules.get("act_seq")):
        size = math.prod(mesh.shape[b] for b in kept + (a,))
        if mesh.shape[a] > 1 and n % size == 0:
            kept += (a,)
    return kept


def weight_specs(w, mesh):
    """Each expert param's PartitionSpec as the rules shard it (an int8 kernel: one for its
    values, one for its scales, jaxformer.core.matmul.Int8Kernel); refused unless the experts
    lie on the expert axis alone."""
    def used(entry):  # the entry's mesh axes of size > 1: nothing to gather over the rest
        kept = tuple(a for a in _axes(entry) if mesh.shape[a] > 1)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def spec(name, v):
        where = P(*map(used, current_spec(v.shape, *param_axes(name))[1]))
        if where[0] != AXIS:
            raise ValueError(f"expert parallelism needs {name}'s experts on the mesh axis "
                             f"{AXIS!r} alone, but they lie on {where[0]!r}: set "
                             "mesh.rules.experts=expert")
        return where
    return {name: jax.tree.map(functools.partial(spec, name), v) for name, v in w.items()}


def expert_parallel_dispatch(x, weights, experts, w, ffn, *, capacity_factor=None, mesh,
                             precision="default"):
    """moe.ragged_dispatch with the experts split over mesh's expert axis. x [N, D],
    weights and experts [N, k], w {name: [E, ...]} (global arrays) -> (y [N, D], 0). A
    quantised precision (model.matmul_precision) scales each device's operands by its own
    amax."""
    n_experts = jax.tree.leaves(w)[0].shape[0]
    check_expert_split(n_experts, mesh.shape[AXIS])
    rows = token_axes(x.shape[0], mesh)
    specs = weight_specs(w, mesh)
    mlp = _axes(jax.tree.leaves(specs["wo"])[0][1])  # wo's products: partial sums over it
    if set(mlp) & set(rows):
        raise ValueError(f"expert parallelism: the experts' hidden axis (expert_mlp -> {mlp}) "
                         f"and the tokens (act_batch, act_seq -> {rows}) share mesh axes")
    local = functools.partial(_local, ffn=ffn, n_experts=n_experts, specs=specs, mlp=mlp,
                              precision=precision)
    tokens = P(rows or None)
    y = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, specs),
                      out_specs=tokens, check_vma=False)(x, weights, experts, w)
    return y, jnp.float32(0)


def _local(x, weights, experts, w, *, ffn, n_experts, specs, mlp, precision="default"):
    """One device: its tokens x [n, D], weights / experts [n, k]; its experts' params."""
    w = {name: jax.tree.map(functools.partial(_gathered, names=param_axes(name)), v, specs[name])
         for name, v in w.items()}
    if mlp and "wo_bias" in w:  # added once, not on every shard of the partial sums
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in mlp])
        w["wo_bias"] = jnp.where(first, w["wo_bias"], 0)
    y = exchange(x, weights, experts, w, ffn, n_experts, precision)
    return jax.lax.psum(y, mlp) if mlp else y


def _gathered(v, spec, names):
    """A param's local shard with its embed dim gathered whole: this device's experts only
    (the experts stay split, and the hidden dim: its products are partial sums)."""
    for dim, (entry, name) in enumerate(zip(tuple(spec), names)):
        if _axes(entry) and name not in ("experts", "expert_mlp"):
            v = jax.lax.all_gather(v, _axes(entry), axis=dim, tiled=True)
    return v


def exchange(x, weights, experts, w, ffn, n_experts: int, precision: str = "default"):
    """Inside shard_map: this device's tokens x [n, D] to the devices of their experts
    (w: the local experts' params [E / X, ...]) and back -> y [n, D]."""
    n, k = experts.shape
    devices = jax.lax.axis_size(AXIS)
    per = n_experts // devices  # experts a device holds
    cap = n * min(k, per)  # the most rows one device sends another
    flat = experts.reshape(-1)  # [n k], token-major
    order = jnp.argsort(flat, stable=True)  # by expert: by device, then local expert
    counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E]
    to_device = counts.reshape(devices, per).sum(-1)  # [X]
    dest = flat[order] // per  # [n k] each sorted assignment's device
    slot = jnp.arange(n * k) - (jnp.cumsum(to_device) - to_device)[dest]  # its row there
    send = jnp.zeros((devices, cap, x.shape[-1]), x.dtype).at[dest, slot].set(
        x[order // k])  # [X, C, D]
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)  # [X, C, D]: row i from device i
    got = jax.lax.all_to_all(counts.reshape(devices, per), AXIS, 0, 0, tiled=True)  # [X, E/X]
    ends = jnp.cumsum(got, axis=-1)  # [X, E/X]: each sender's rows are sorted by expert
    mine = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(cap), side="right"))(ends)  # [X, C]
    # each received row through its local expert (padding rows: expert E/X, none: zeros)
    out, _ = ragged_dispatch(recv.reshape(devices * cap, -1),
                             jnp.ones((devices * cap, 1), jnp.float32),
                             mine.reshape(-1, 1), w, ffn,
                             precision=precision)  # [X C, D]
    back = jax.lax.all_to_all(out.reshape(devices, cap, -1), AXIS, 0, 0, tiled=True)
    ys = back[dest, slot]  # [n k, D]: where each sorted assignment's row went
    ys = ys[jnp.argsort(order)].reshape(n, k, -1)  # token order again
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


# the dispatches (jaxformer.moe.experts.DISPATCHES) that have an expert-parallel form; the others
# run as written on an expert mesh, partitioned by the compiler
PARALLEL = {"ragged": expert_parallel_dispatch}


def dispatch_for(name: str):
    """The dispatch `name` (moe.DISPATCHES), expert parallel when the current mesh
    (jaxformer.core.sharding.sharding_context) has an expert axis > 1 and it has that form."""
    mesh = expert_mesh()
    if mesh is None or name not in PARALLEL:
        return DISPATCHES[name]
    return functools.partial(PARALLEL[name], mesh=mesh)
