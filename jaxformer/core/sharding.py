"""Sharding: the device mesh, logical axis rules, sharded init and batch placement.

Every param carries logical axis names (``nn.with_logical_partitioning``) and key
activations carry logical constraints (``constrain``); a rule table maps each logical
name to mesh axes of the ``('data', 'fsdp', 'tensor', 'context', 'expert')`` mesh:

    data    replicas: the batch is split over it, params are copied on it
    fsdp    the batch is split over it too, and params and optimizer state are sharded
            along their embed axis (ZeRO-3 / FSDP: gathered just before use)
    tensor  Megatron tensor parallelism: attention heads and the FFN hidden axis split,
            one all-reduce after the attention output and one after the FFN
    context context parallelism: the sequence of every activation is split (params are
            not); attention runs as ring attention or over gathered keys (jaxformer.attention.ring)
    expert  expert parallelism: a mixture's experts split (each device holds E / expert of
            them, whole but for fsdp / tensor), tokens sent to their experts' devices and
            back by all-to-all (jaxformer.moe.expert_parallel); the batch is split over it too

A mesh of (n, 1, 1) is data parallel, (1, n, 1) FSDP, (1, 1, n) tensor parallel, and any
product of them combines them (context and expert are keywords of make_mesh). The same
jitted code runs on all of them, and on one CPU.
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
from contextlib import contextmanager
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer.core.validation import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "context", "expert")

# logical name -> mesh axes (None = replicated). Params use the plain names; activations
# the act_ ones, so that an activation's embed axis stays whole while FSDP shards the
# params' embed axis over the same mesh axis as the batch.
DEFAULT_RULES: dict[str, Any] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,
    "table": None,         # learned position table rows, T5 buckets
    "pos_mlp": None,       # FIRE's hidden layer
    "lora_rank": None,     # an adapter's rank
    "latent": None,        # MLA's latents (kv_lora_rank, q_lora_rank)
    "experts": "expert",   # a mixture's experts (their kernels' leading axis, the router's)
    "expert_mlp": "tensor",  # an expert's hidden axis
    "conv_taps": None,     # a recurrent mixer's short convolution's taps
    "state": None,         # a recurrent state's width (SSM state, keys of a delta rule)
    "mixer_groups": None,  # Mamba-2's B/C groups
    "act_batch": ("data", "fsdp", "expert"),  # expert devices share the batch outside MoE
    "act_seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


_MESH: contextvars.ContextVar = contextvars.ContextVar("jaxformer_mesh", default=None)


def constrain(x, *names):
    """Ask for x's sharding by logical names; a no-op outside `sharding_context`. A mesh
    axis that does not divide its dim (batch 1 over data=8) is left out for that dim."""
    where = current_spec(x.shape, *names)
    return x if where is None else jax.lax.with_sharding_constraint(x, NamedSharding(*where))


def current_spec(shape, *names):
    """(mesh, PartitionSpec) of an array of `shape` whose dims have these logical names,
    under `sharding_context` (axes that do not divide a dim left out); None outside it."""
    rules, mesh = nn.get_logical_axis_rules(), _MESH.get()
    if not rules or mesh is None:
        return None
    return mesh, _fit(nn.logical_to_mesh_axes(names, rules), shape, mesh)


def init_with_names(init, *names):
    """A param initializer whose param carries these logical axis names."""
    return nn.with_logical_partitioning(init, names)


# ---- rules and mesh -----------------------------------------------------------------


def resolve_rules(overrides: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """DEFAULT_RULES updated by `overrides` (mesh.rules in a config) as flax's rule list.

    A value is a mesh axis, a list of mesh axes, or None (replicate)."""
    rules = dict(DEFAULT_RULES)
    for name, axes in (overrides or {}).items():
        if name not in DEFAULT_RULES:
            raise ConfigError(f"mesh.rules.{name}: unknown logical axis; logical axes are: "
                              f"{', '.join(DEFAULT_RULES)}")
        axes = _as_axes(name, axes)
        rules[name] = axes
    return tuple(rules.items())


def _as_axes(name: str, axes: Any):
    if isinstance(axes, str) and axes.lower() in ("none", "null", ""):
        axes = None
    if isinstance(axes, str) and "," in axes:
        axes = [a.strip() for a in axes.split(",")]
    listed = [] if axes is None else [axes] if isinstance(axes, str) else list(axes)
    bad = [a for a in listed if a not in MESH_AXES]
    if bad or not all(isinstance(a, str) for a in listed):
        raise ConfigError(f"mesh.rules.{name}={axes!r}: mesh axes are {', '.join(MESH_AXES)} "
                          "(a name, a list of names, or null to replicate)")
    return None if not listed else listed[0] if len(listed) == 1 else tuple(listed)


def mesh_shape(data: int, fsdp: int, tensor: int, n_devices: int, context: int = 1,
               expert: int = 1) -> tuple[int, ...]:
    """The (data, fsdp, tensor, context, expert) sizes, one -1 standing for the remaining
    devices."""
    sizes = [data, fsdp, tensor, context, expert]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh.data/fsdp/tensor/context/expert = {sizes}: at most one may "
                          "be -1")
    if -1 in sizes:
        rest = int(np.prod([s for s in sizes if s != -1]))
        if n_devices % rest:
            raise ConfigError(f"mesh {sizes}: {n_devices} devices are not divisible by {rest}, "
                              "the product of the given axes")
        sizes[sizes.index(-1)] = n_devices // rest
    if int(np.prod(sizes)) != n_devices:
        raise ConfigError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} x "
                          f"context={sizes[3]} x expert={sizes[4]} = {int(np.prod(sizes))} "
                          f"devices, but there are {n_devices}; make the product equal the "
                          "device count, or set one axis to -1")
    return tuple(sizes)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, context: int = 1, devices=None,
              expert: int = 1) -> jax.sharding.Mesh:
    """A ('data', 'fsdp', 'tensor', 'context', 'expert') mesh over `devices` (default: all,
    on every process)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices), context, expert)
    return jax.make_mesh(shape, MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def check_context_split(seq_len: int, context: int) -> None:
    """A sequence split over `context` devices in zigzag order needs 2 * context chunks."""
    if context > 1 and seq_len % (2 * context):
        raise ConfigError(f"train.seq_len={seq_len} must be a multiple of 2 x mesh.context = "
                          f"{2 * context} (mesh.context={context}: each device holds two "
                          "chunks of the zigzag order)")


def check_expert_split(experts: int, expert: int) -> None:
    """Each of the `expert` devices holds experts / expert whole experts."""
    if experts and expert > 1 and experts % expert:
        raise ConfigError(f"model.moe.experts={experts} is not divisible by mesh.expert="
                          f"{expert}; each expert-parallel device holds the same number of "
                          "experts: make mesh.expert a divisor of the experts")


def expert_mesh():
    """The mesh under sharding_context when it has an expert axis > 1 (the mixtures of
    experts then run expert parallel: jaxformer.moe.expert_parallel); else None."""
    mesh = _MESH.get()
    if mesh is None or mesh.shape.get("expert", 1) == 1 or not nn.get_logical_axis_rules():
        return None
    return mesh


def batch_devices(mesh, rules) -> int:
    """How many ways a batch's rows are split: the product of the mesh axes act_batch maps
    to (data x fsdp x expert by default)."""
    axes = dict(rules).get("act_batch")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes]))


def sequence_split():
    """(mesh, its axis the sequence is split over, the axes of the rows, of the heads)
    under sharding_context when act_seq maps to a mesh axis of size > 1; else None."""
    rules, mesh = dict(nn.get_logical_axis_rules()), _MESH.get()
    axis = rules.get("act_seq") if mesh is not None else None
    if not isinstance(axis, str) or mesh.shape.get(axis, 1) == 1:
        return None
    names = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)  # noqa: E731
    return mesh, axis, names(rules.get("act_batch")), names(rules.get("act_heads"))


@contextmanager
def sharding_context(mesh, rules):
    """Within it, `constrain` resolves logical names on `mesh` by `rules`. Enter it where
    the function is traced: inside a jitted function's body, or around its first call."""
    token = _MESH.set(mesh)
    try:
        with nn.logical_axis_rules(rules):
            yield
    finally:
        _MESH.reset(token)


def traced_under(mesh, rules, fn):
    """fn, running (so traced, when jitted) inside sharding_context; fn itself if no mesh."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with sharding_context(mesh, rules):
            return fn(*args, **kwargs)
    return wrapped


# ---- params ---------------------------------------------------------------------------


def _abstract_params(model, *args):
    """The params of model.init as ShapeDtypeStructs, still boxed with their logical names
    (allocates nothing). args: example inputs after the rng (default: one token)."""
    args = args or (jax.ShapeDtypeStruct((1, 1), jnp.int32),)
    return jax.eval_shape(lambda: nn.Module.init(model, jax.random.key(0), *args))["params"]


def logical_axes(model, *args):
    """The params' logical PartitionSpecs, from an abstract init (allocates nothing).
    args: example inputs of model.init after the rng (default: one token)."""
    return nn.get_partition_spec(_abstract_params(model, *args))


def _fit(spec: P, shape, mesh) -> P:
    """Drop a mesh axis from a dim it does not divide (e.g. 2 kv heads over tensor=4):
    that dim is replicated instead of failing."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        kept = tuple(a for a in names if dim % int(np.prod([mesh.shape[b] for b in names])) == 0)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def shardings_for(specs, shapes, mesh, rules):
    """NamedShardings for a tree of logical specs and the matching tree of shapes."""
    mesh_specs = nn.logical_to_mesh(specs, rules)
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
                        mesh_specs, shapes, is_leaf=lambda x: isinstance(x, P))


def param_shardings(model, mesh, rules):
    """The params' NamedShardings on `mesh` as `rules` map their logical names."""
    boxed = _abstract_params(model)
    return shardings_for(nn.get_partition_spec(boxed), nn.unbox(boxed), mesh, rules)


def per_device_bytes(tree) -> int:
    """Bytes of a tree of arrays held by the first device (the largest shard count)."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


# ---- batches --------------------------------------------------------------------------


def batch_sharding(mesh, rules) -> NamedSharding:
    """Rows of a [B, T] batch split over the axes act_batch maps to (data x fsdp x expert),
    its sequence over those act_seq maps to (context)."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(("act_batch", "act_seq"), rules))


def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of a global batch that this process's devices hold (each process reads
    only these)."""
    idx = sharding.addressable_devices_indices_map((batch_size, sharding.mesh.size)).values()
    starts = [i[0].start or 0 for i in idx]
    stops = [batch_size if i[0].stop is None else i[0].stop for i in idx]
    lo, hi = min(starts), max(stops)
    if hi - lo != sum(len(range(a, b)) for a, b in set(zip(starts, stops))):
        raise ValueError("this process's devices hold non-contiguous batch rows; order the "
                         "mesh so that each process owns a contiguous block of data x fsdp")
    return slice(lo, hi)


def place_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding, batch_size: int):
    """This process's rows of each batch array -> global arrays [batch_size, ...]."""
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
            for k, v in local.items()}


# ---- multi-host -----------------------------------------------------------------------


def cluster_detected() -> bool:
    """A launcher that jax.distributed.initialize() can read without arguments started
    several processes: SLURM (srun), a Cloud TPU pod slice, or Open MPI."""
    env = os.environ
    return (int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env) \
        or "," in env.get("TPU_WORKER_HOSTNAMES", "") \
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           cpu_collectives: str = "gloo", heartbeat_s: float = 10.0) -> bool:
    """jax.distributed.initialize from explicit settings, or from the environment when a
    cluster launcher is detected; a no-op on one process. Call it before anything touches
    devices. Returns whether this is a multi-process run. JAX's own heartbeat timeout is
    kept well above `heartbeat_s` (training/peers.py's watch, which reports a lost process
    in one line): when JAX's fires first it aborts the survivors with C++ stack traces."""
    explicit = coordinator_address is not None
    if not explicit and not cluster_detected():
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax_heartbeat = max(100, math.ceil(3 * heartbeat_s))  # 100: JAX's default
    if explicit:
        if num_processes is None or process_id is None:
            raise ConfigError("distributed.coordinator_address is set; set "
                              "distributed.num_processes and distributed.process_id too")
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   heartbeat_timeout_seconds=jax_heartbeat)
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=jax_heartbeat)
    return True
