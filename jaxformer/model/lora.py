"""LoRA (Hu et al. 2021): a projection W becomes W + (alpha / r) A B, with A [in, r] and
B [r, out] trained and W frozen.

The adapters are params of the model like any other (`attn/query_lora/{lora_a, lora_b,
lora_scale}` beside `attn/query/kernel`; lora_scale: alpha / r, frozen), so every
forward, the KV-cached decoder, scan_layers, remat and every mesh see them without a
second code path; the update is computed as (x A) B, never as a merged weight. Training
takes the gradient of the adapters alone (`partition` splits the params tree into
adapters and base, `combine` joins them), so the base is frozen and out of the optimizer
state. `merge` folds the adapters into the
weights (for export); `delta` is one projection's W update.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.matmul import flat_dot_general
from jaxformer.core.sharding import init_with_names
from jaxformer.core.validation import ConfigError, Section, check_number
from jaxformer.model.layer_runs import is_stacked

# The projections an adapter can target, by the names of their params, and the groups
ATTENTION = ("query", "key", "value", "out")
MLP = ("wi", "wi_gate", "wi_up", "wo")
GROUPS = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}
PARAMS = ("lora_a", "lora_b")  # an adapter's trained leaves
SCALE = "lora_scale"           # and its frozen alpha / r


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """model.lora: low-rank adapters on the projections `targets` (names from ATTENTION
    and MLP, or the groups attention, mlp, all); rank 0: none.

    alpha: the update is scaled by alpha / rank (as PEFT's lora_alpha). dropout: on the
    adapter's input only (as PEFT). A is drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (PEFT's default, kaiming-uniform with a = sqrt 5) and B is 0, so a new adapter leaves
    the model as it was."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all",)
    seed: int = 0
    sweep_rank: tuple[int, ...] = ()
    sweep_seeds: int = 1

    SECTION = "model.lora"

    def __post_init__(self):
        o = self.SECTION
        ranks = self.sweep_rank
        if isinstance(ranks, (str, int)):
            ranks = [r for r in str(ranks).split(",") if r.strip()]
        try:
            object.__setattr__(self, "sweep_rank", tuple(int(r) for r in ranks))
        except (TypeError, ValueError):
            raise ConfigError(f"model.lora.sweep_rank={self.sweep_rank!r} must be ranks, e.g. "
                              "4,8,16") from None
        if any(r < 1 for r in self.sweep_rank):
            raise ConfigError(f"model.lora.sweep_rank={list(self.sweep_rank)}: ranks are >= 1")
        check_number(o, "seed", self.seed, int, low=0)
        check_number(o, "sweep_seeds", self.sweep_seeds, int, low=1)
        if self.sweep_rank and self.rank not in (0, max(self.sweep_rank)):
            raise ConfigError(f"model.lora.rank={self.rank} with sweep_rank="
                              f"{list(self.sweep_rank)}: leave rank out (it is the largest)")
        if self.sweep_rank:
            object.__setattr__(self, "rank", max(self.sweep_rank))
        check_number(o, "rank", self.rank, int, low=0)
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        object.__setattr__(self, "targets", tuple(targets))
        check_number(o, "alpha", self.alpha, float, low=0, low_open=True)
        check_number(o, "dropout", self.dropout, float, low=0, high=1, high_open=True)
        if not self.rank:
            self.check_unused()
        bad = [t for t in self.targets if t not in ATTENTION + MLP and t not in GROUPS]
        if bad or not self.targets:
            raise ConfigError(f"model.lora.targets={list(self.targets)}: {', '.join(bad) or 'empty'}"
                              f" is not a projection; choose from {', '.join(ATTENTION + MLP)}"
                              f" or the groups {', '.join(GROUPS)}")

    def check_unused(self) -> None:
        """At rank 0 (no adapters) every other field must hold its default: one set would
        be ignored (a full fine-tune where adapters were meant)."""
        for f in dataclasses.fields(self):  # rank among them, at its default 0
            value = getattr(self, f.name)
            if value != f.default:
                shown = (",".join(map(str, value)) if isinstance(value, tuple) else
                         f"{value:g}" if isinstance(value, float) else value)
                raise ConfigError(f"model.lora.{f.name}={shown} is set but model.lora.rank=0 "
                                  "(no adapters); set model.lora.rank")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def members(self) -> tuple["LoRAConfig", ...]:
        """The adapters a sweep trains side by side (each rank, then each seed); one
        adapter, this one, without a sweep."""
        if not self.sweep_rank and self.sweep_seeds == 1:
            return (self,)
        return tuple(dataclasses.replace(self, rank=r, seed=self.seed + s, sweep_rank=(),
                                         sweep_seeds=1)
                     for r in (self.sweep_rank or (self.rank,)) for s in range(self.sweep_seeds))

    def projections(self) -> frozenset[str]:
        """The targeted projection names, groups expanded (none at rank 0)."""
        if not self.rank:
            return frozenset()
        return frozenset(p for t in self.targets for p in GROUPS.get(t, (t,)))

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "targets": list(self.targets),
                "sweep_rank": list(self.sweep_rank)}


def check_expert_targets(cfg) -> None:
    """Refuse adapters named for MLP projections that a model does not have: a mixture of
    experts' routed kernels take none (only its shared experts, a plain feed-forward, do),
    so on a model whose every layer is sparse without shared experts `mlp` would adapt
    nothing. cfg: the ModelConfig; "all" adapts what there is and is never refused."""
    named = [t for t in cfg.lora.targets if t == "mlp" or t in MLP]
    if not cfg.lora.rank or not named or not all(cfg.sparse_layers) or cfg.shared_d_ff:
        return
    raise ConfigError(f"model.lora.targets names {', '.join(named)}, but every layer's "
                      "feed-forward is a mixture of experts without shared experts, whose "
                      "routed experts take no adapters; target attention (or all), or add "
                      "model.moe.shared_experts")


def _uniform_columns(bound: float, seed: int):
    """U(-bound, bound) drawn column by column (the last axis: the rank), so the first r
    columns of a rank-R adapter are those of a rank-r one with the same seed."""
    def init(key, shape, dtype=jnp.float32):
        key = jax.random.fold_in(key, seed)
        cols = [jax.random.uniform(jax.random.fold_in(key, j), shape[:-1], dtype, -bound, bound)
                for j in range(shape[-1])]
        return jnp.stack(cols, axis=-1)
    return init


class LoRA(nn.Module):
    """scale * dropout(x) A B for a projection contracting x's last `in_axes` axes:
    A [in..., r], B [r, out...], named by the projection's kernel axes `names`."""

    cfg: LoRAConfig
    in_axes: int
    out_shape: tuple[int, ...]
    names: tuple[str, ...]  # the kernel's logical axes: in..., out...
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        n, r = self.in_axes, self.cfg.rank
        fan_in = math.prod(x.shape[-n:])
        a = self.param("lora_a", init_with_names(_uniform_columns(1 / math.sqrt(fan_in),
                                                                  self.cfg.seed),
                                                 *self.names[:n], "lora_rank"),
                       (*x.shape[-n:], r), self.param_dtype)
        b = self.param("lora_b", init_with_names(nn.initializers.zeros, "lora_rank",
                                                 *self.names[n:]),
                       (r, *self.out_shape), self.param_dtype)
        # alpha / r as a (frozen) param: a sweep's adapters each carry their own
        scale = self.param("lora_scale", init_with_names(nn.initializers.constant(
            self.cfg.scale)), (), jnp.float32)
        x = nn.Dropout(self.cfg.dropout)(x, deterministic=self.deterministic)
        x, a, b = (t.astype(self.dtype) for t in (x, a, b))
        z = flat_dot_general(x, a, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))),
                                    ((), ())))  # [B, T, r]
        y = flat_dot_general(z, b, (((z.ndim - 1,), (0,)), ((), ())))  # [B, T, out...]
        return y * scale.astype(y.dtype)


def adapted(module: nn.Module, cfg: LoRAConfig, name: str, y, x, in_axes: int,
            names: tuple[str, ...], dtype, param_dtype, deterministic=True):
    """y (projection `name` of x) plus its adapter's update when `cfg` targets it. Called
    inside `module`'s compact method: the adapter is its submodule `{name}_lora`."""
    if name not in cfg.projections():
        return y
    return y + LoRA(cfg, in_axes, y.shape[x.ndim - in_axes:], names, dtype, param_dtype,
                    deterministic, parent=module, name=f"{name}_lora")(x)


# ---- the params tree: adapters against base ------------------------------------------

def _leaf(path) -> str:
    last = path[-1]
    return getattr(last, "key", last)


def is_adapter(path) -> bool:
    """A params-tree path (a tuple of keys) leading to an adapter's A or B (trained)."""
    return _leaf(path) in PARAMS


def partition(params, *, scales: bool = False) -> tuple[dict, ...]:
    """(adapters, base): the params tree split into trees with disjoint leaves, A and B
    against the rest; with scales, (adapters, scales, base): each adapter's alpha / r
    apart too (a sweep's, one per member, like its adapters)."""
    flat = _flatten(params)
    group = lambda k: 0 if is_adapter(k) else 1 if scales and _leaf(k) == SCALE else 2  # noqa
    parts = [_unflatten({k: v for k, v in flat.items() if group(k) == g}) for g in range(3)]
    return tuple(parts) if scales else (parts[0], parts[2])


def combine(*trees) -> dict:
    """The inverse of partition."""
    return _unflatten({k: v for t in trees for k, v in _flatten(t).items()})


def _flatten(tree) -> dict:
    from flax.traverse_util import flatten_dict
    return flatten_dict(dict(tree)) if tree else {}


def _unflatten(flat) -> dict:
    from flax.traverse_util import unflatten_dict
    return unflatten_dict(flat) if flat else {}


def delta(a, b, kernel_ndim: int, scale: float, xp=jnp):
    """scale * A B shaped like the kernel: A [L.., in..., r], B [L.., r, out...] with L..
    the layer axes a scanned model stacks in front (kernel_ndim says how many)."""
    lead = a.ndim + b.ndim - 2 - kernel_ndim
    a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [L.., in, r]
    b2 = b.reshape(*b.shape[:lead + 1], -1)           # [L.., r, out]
    d = xp.einsum("...ir,...ro->...io", a2, b2)
    return scale * d.reshape(*a.shape[:-1], *b.shape[lead + 1:])


def adapter_path(kernel_path, leaf: str) -> tuple:
    """The path of a kernel's adapter leaf: attn/query/kernel -> attn/query_lora/leaf."""
    return tuple(kernel_path[:-2]) + (kernel_path[-2] + "_lora", leaf)


def merge(params, xp=np) -> dict:
    """The params with every adapter folded into its kernel (W + lora_scale A B, computed
    in float64 with NumPy by default) and the adapters removed: the model without LoRA."""
    flat = _flatten(params)
    out = {k: v for k, v in flat.items() if not is_adapter(k) and k[-1] != SCALE}
    f64 = (lambda x: xp.asarray(x, xp.float64)) if xp is np else xp.asarray
    for k in flat:
        if k[-1] != "lora_a":
            continue
        module = k[:-2] + (k[-2][:-len("_lora")], "kernel")  # attn/query_lora -> attn/query
        kernel = flat[module]
        d = delta(f64(flat[k]), f64(flat[k[:-1] + ("lora_b",)]), kernel.ndim, 1.0, xp)
        scale = f64(flat[k[:-1] + (SCALE,)])  # [] or [L] (scanned)
        d = d * scale.reshape(scale.shape + (1,) * (d.ndim - scale.ndim))
        out[module] = (xp.asarray(kernel, d.dtype) + d).astype(kernel.dtype)
    return _unflatten(out)


def member(cfg: LoRAConfig, params, i: int) -> tuple[LoRAConfig, dict]:
    """A sweep's adapter i alone: its LoRAConfig, and params with its A and B (cut to its
    rank) and scale in place of the stacked ones."""
    m = cfg.members()[i]
    flat = _flatten(params)
    for k, v in flat.items():
        if _leaf(k) in PARAMS + (SCALE,):
            v = v[i]
            if _leaf(k) == "lora_a":
                v = v[..., :m.rank]
            elif _leaf(k) == "lora_b":  # [L.., r, out...], L..: the scanned layers
                v = v[(slice(None),) * is_stacked(k[0]) + (slice(0, m.rank),)]
            flat[k] = v
    return m, _unflatten(flat)


def pick_member(cfg: LoRAConfig, params, i: int | None) -> tuple[LoRAConfig, dict]:
    """member(cfg, params, i) for a sweep (i required); cfg and params as they are for one
    adapter (i must be None)."""
    members = cfg.members()
    if len(members) == 1:
        if i is not None:
            raise ConfigError("--member picks one adapter of a sweep; this run has one")
        return cfg, params
    if i is None or not 0 <= i < len(members):
        raise ConfigError(f"the run is a sweep of {len(members)} adapters (" + ", ".join(
            f"{j}: rank {m.rank} seed {m.seed}" for j, m in enumerate(members)) +
            "); pick one with --member I")
    return member(cfg, params, i)


def base_only(params):
    """params with every adapter's lora_scale at 0: the model without its adapters (the
    post-training objectives' frozen reference)."""
    return _unflatten({k: jnp.zeros_like(v) if k[-1] == SCALE else v
                       for k, v in _flatten(params).items()})
