"""LoRA (Hu et al. 2021): a projection W becomes W + (alpha / r) A B, with A [in, r] and
B [r, out] trained and W frozen.

The adapters are params of the model like any other (`attn/query_lora/{lora_a, lora_b}`
beside `attn/query/kernel`), so every forward, the KV-cached decoder, scan_layers, remat
and every mesh see them without a second code path; the update is computed as
(x A) B, never as a merged weight. Training takes the gradient of the adapters alone
(`partition` splits the params tree into adapters and base, `combine` joins them), so
the base is frozen and out of the optimizer state. `merge` folds the adapters into the
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

from jaxformer.matmul import flat_dot_general
from jaxformer.sharding import init_with_names
from jaxformer.validation import ConfigError, Section, check_number

# The projections an adapter can target, by the names of their params, and the groups
ATTENTION = ("query", "key", "value", "out")
MLP = ("wi", "wi_gate", "wi_up", "wo")
GROUPS = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}
PARAMS = ("lora_a", "lora_b")  # the two leaves of an adapter


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

    SECTION = "model.lora"

    def __post_init__(self):
        o = self.SECTION
        check_number(o, "rank", self.rank, int, low=0)
        check_number(o, "alpha", self.alpha, float, low=0, low_open=True)
        check_number(o, "dropout", self.dropout, float, low=0, high=1, high_open=True)
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        object.__setattr__(self, "targets", tuple(targets))
        bad = [t for t in self.targets if t not in ATTENTION + MLP and t not in GROUPS]
        if bad or not self.targets:
            raise ConfigError(f"model.lora.targets={list(self.targets)}: {', '.join(bad) or 'empty'}"
                              f" is not a projection; choose from {', '.join(ATTENTION + MLP)}"
                              f" or the groups {', '.join(GROUPS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def projections(self) -> frozenset[str]:
        """The targeted projection names, groups expanded (none at rank 0)."""
        if not self.rank:
            return frozenset()
        return frozenset(p for t in self.targets for p in GROUPS.get(t, (t,)))

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "targets": list(self.targets)}


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
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
        a = self.param("lora_a", init_with_names(_uniform(1 / math.sqrt(fan_in)),
                                                 *self.names[:n], "lora_rank"),
                       (*x.shape[-n:], r), self.param_dtype)
        b = self.param("lora_b", init_with_names(nn.initializers.zeros, "lora_rank",
                                                 *self.names[n:]),
                       (r, *self.out_shape), self.param_dtype)
        x = nn.Dropout(self.cfg.dropout)(x, deterministic=self.deterministic)
        x, a, b = (t.astype(self.dtype) for t in (x, a, b))
        z = flat_dot_general(x, a, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))),
                                    ((), ())))  # [B, T, r]
        y = flat_dot_general(z, b, (((z.ndim - 1,), (0,)), ((), ())))  # [B, T, out...]
        return y * jnp.asarray(self.cfg.scale, y.dtype)


def adapted(module: nn.Module, cfg: LoRAConfig, name: str, y, x, in_axes: int,
            names: tuple[str, ...], dtype, param_dtype, deterministic=True):
    """y (projection `name` of x) plus its adapter's update when `cfg` targets it. Called
    inside `module`'s compact method: the adapter is its submodule `{name}_lora`."""
    if name not in cfg.projections():
        return y
    return y + LoRA(cfg, in_axes, y.shape[x.ndim - in_axes:], names, dtype, param_dtype,
                    deterministic, parent=module, name=f"{name}_lora")(x)


# ---- the params tree: adapters against base ------------------------------------------

def is_adapter(path) -> bool:
    """A params-tree path (a tuple of keys) leading to an adapter's A or B."""
    last = path[-1]
    return getattr(last, "key", last) in PARAMS


def partition(params) -> tuple[dict, dict]:
    """(adapters, base): the params tree split into two trees with disjoint leaves."""
    flat = _flatten(params)
    return (_unflatten({k: v for k, v in flat.items() if is_adapter(k)}),
            _unflatten({k: v for k, v in flat.items() if not is_adapter(k)}))


def combine(adapters, base) -> dict:
    """The inverse of partition."""
    return _unflatten({**_flatten(base), **_flatten(adapters)})


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


def merge(params, cfg: LoRAConfig, xp=np) -> dict:
    """The params with every adapter folded into its kernel (W + scale A B, computed in
    float64 with NumPy by default) and the adapters removed: the model without LoRA."""
    flat = _flatten(params)
    out = {k: v for k, v in flat.items() if not is_adapter(k)}
    for k in flat:
        if k[-1] != "lora_a":
            continue
        module = k[:-2] + (k[-2][:-len("_lora")], "kernel")  # attn/query_lora -> attn/query
        kernel = flat[module]
        d = delta(xp.asarray(flat[k], xp.float64 if xp is np else None),
                  xp.asarray(flat[k[:-1] + ("lora_b",)], xp.float64 if xp is np else None),
                  kernel.ndim, cfg.scale, xp)
        out[module] = (xp.asarray(kernel, d.dtype) + d).astype(kernel.dtype)
    return _unflatten(out)
