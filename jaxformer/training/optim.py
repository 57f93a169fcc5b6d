"""The optimizers (optim.name) and learning-rate schedules (optim.schedule), one entry
each in OPTIMIZERS and SCHEDULES: AdamW (no decay on norms, biases and embeddings), Muon
on the blocks' matrices beside AdamW on the rest, or Lion; clipping and skipping of
non-finite steps around them, all from optax.

An optimizer's own settings are a frozen dataclass its entry declares (fields, defaults,
checks); in the optim section they sit flat beside the common ones (optim.b2=0.99,
optim.muon_beta=0.9), and OptimConfig.settings is the chosen entry's. A new optimizer is
one entry (its settings' keys must be OptimConfig fields: test_optim checks it)::

    @dataclasses.dataclass(frozen=True)
    class Sign:
        weight_decay: float = 0.0

    OPTIMIZERS["sign"] = Optimizer(Sign, lambda s, lr: optax.chain(
        optax.scale_by_sign(), optax.add_decayed_weights(s.weight_decay, decay_mask),
        optax.scale_by_learning_rate(lr)))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jaxformer.core.validation import ConfigError, check_choice, check_number
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_runs import is_stacked
from jaxformer.model.quantize import CONTRACTED_AXES, EXPERTS

LATENT_UPS = ("key_up", "value_up")  # MLA's up-projections: [latent, heads, head_dim]
STACKS = ("encoder", "decoder")  # an encoder-decoder's stacks: each holds blocks of its own


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer (name: an entry of OPTIMIZERS: adamw; muon on the blocks' matrices
    with AdamW on the rest; lion) with a learning-rate schedule (an entry of SCHEDULES),
    global-norm clipping and gradient accumulation.

    schedule: cosine (linear warmup, cosine decay to lr * min_lr_ratio), linear (warmup,
    linear decay to lr * min_lr_ratio), constant (warmup, then lr), inverse_sqrt
    (lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): Vaswani et al. with lr = 1).
    label_smoothing: the target distribution (1 - e) one-hot + e / vocab (optax's
    smooth_labels; Vaswani et al.'s 0.1), in the encoder-decoder's loss.

    The rest are the optimizers' own settings, each read by the optimizers whose settings
    class declares it (None: that class's default; after construction, the value used, and
    None where the chosen optimizer has no such setting): b1, b2, eps, weight_decay
    (AdamW's, and Muon's for the rest; Lion's b1, b2, weight_decay); muon_beta (Muon's
    momentum) and muon_rms (its updates' RMS per sqrt(max(fan_in, fan_out)): 0.2 matches
    AdamW's, so lr and weight_decay serve both). Another optimizer's setting is refused,
    unless it holds that optimizer's default (a run's saved config.yaml lists every field).
    """

    name: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    clip_norm: float | None = 1.0
    grad_accum: int = 1
    max_skips: int = 5  # consecutive non-finite steps before the run stops
    label_smoothing: float = 0.0
    b1: float | None = None
    b2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    muon_beta: float | None = None
    muon_rms: float | None = None

    def __post_init__(self):
        o = "optim"
        check_number(o, "label_smoothing", self.label_smoothing, float, low=0, high=1,
                     high_open=True)
        check_choice(o, "name", self.name, OPTIMIZERS)
        check_number(o, "lr", self.lr, float, low=0, low_open=True)
        check_choice(o, "schedule", self.schedule, SCHEDULES)
        check_number(o, "warmup_steps", self.warmup_steps, int, low=0)
        SCHEDULES[self.schedule].check(self)
        check_number(o, "min_lr_ratio", self.min_lr_ratio, float, low=0, high=1)
        check_number(o, "clip_norm", self.clip_norm, float, low=0, low_open=True, optional=True)
        check_number(o, "grad_accum", self.grad_accum, int, low=1)
        check_number(o, "max_skips", self.max_skips, int, low=1)
        settings = OPTIMIZERS[self.name].settings_from(self)
        for key in setting_keys():  # the values used; None where this optimizer has none
            object.__setattr__(self, key, getattr(settings, key, None))

    @property
    def settings(self):
        """The chosen optimizer's settings: an instance of its entry's settings class."""
        entry = OPTIMIZERS[self.name]
        return entry.settings(**{k: getattr(self, k) for k in entry.keys()})


# ---- schedules ------------------------------------------------------------------


def inverse_sqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
    """Vaswani et al. (2017): scale * d^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Optimizer step 0 is the paper's step 1 (the paper's formula is undefined at 0).
    """
    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

    return schedule


def warmup_then(cfg: OptimConfig, decay):
    """Linear warmup from 0 to cfg.lr over cfg.warmup_steps, then `decay`."""
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), decay],
                                [cfg.warmup_steps])


def needs_warmup(cfg: OptimConfig) -> None:
    if cfg.warmup_steps < 1:
        raise ConfigError(f"optim.warmup_steps must be >= 1 for schedule={cfg.schedule}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One learning-rate schedule (optim.schedule). make(cfg, model, total_steps) -> the
    optax schedule of optimizer step counts; check(cfg) refuses the settings it cannot take,
    in one line."""

    make: Callable
    check: Callable[[OptimConfig], None] = lambda cfg: None


SCHEDULES: dict[str, Schedule] = {
    "cosine": Schedule(lambda cfg, model, total: optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(total, cfg.warmup_steps + 1),
        cfg.lr * cfg.min_lr_ratio)),
    "inverse_sqrt": Schedule(lambda cfg, model, total: inverse_sqrt_schedule(
        model.d_model, cfg.warmup_steps, cfg.lr), check=needs_warmup),
    "constant": Schedule(lambda cfg, model, total: warmup_then(
        cfg, optax.constant_schedule(cfg.lr))),
    "linear": Schedule(lambda cfg, model, total: warmup_then(cfg, optax.linear_schedule(
        cfg.lr, cfg.lr * cfg.min_lr_ratio, max(total - cfg.warmup_steps, 1)))),
}


def learning_rate_schedule(cfg: OptimConfig, model: ModelConfig, total_steps: int):
    return SCHEDULES[cfg.schedule].make(cfg, model, total_steps)


# ---- Muon's view of the params --------------------------------------------------


def decay_mask(params):
    """Weight decay on matmul kernels (and LoRA's A and B) only: not on norms, biases or
    embeddings."""
    def is_kernel(path, _):
        return getattr(path[-1], "key", None) in ("kernel", "lora_a", "lora_b")

    return jax.tree_util.tree_map_with_path(is_kernel, params)


def block_key(names):
    """The layer key (block_i, or a stacked run's) a param's path names sit under, or None
    outside the blocks: at the top, or under an encoder-decoder's encoder/ or decoder/."""
    key = names[1] if names[0] in STACKS and len(names) > 1 else names[0]
    return key if key.startswith("block_") or is_stacked(key) else None


def muon_dimensions(tree):
    """Muon's view of each param (or of each update, where optax.partition has masked the
    others): MuonDimensionNumbers for a block's matrix (a decoder's; an encoder-decoder's
    encoder and decoder blocks', cross-attention too), [(layers,) (experts,) in..., out...]
    (a kernel, an expert stack, MLA's key_up / value_up; the attention output reads heads x
    head_dim), None for the rest (AdamW): embeddings, the LM head, norms, biases, position
    tables, sinks and LoRA's adapters."""
    def dims(path, x):
        if isinstance(x, optax.MaskedNode):
            return x
        names = [str(getattr(k, "key", k)) for k in path]
        leaf, layer = names[-1], block_key(names)
        if layer is None or any("lora" in n for n in names) or \
                leaf not in ("kernel", *EXPERTS, *LATENT_UPS):
            return None
        lead = int(is_stacked(layer)) + int(leaf in EXPERTS)  # batch axes: each its own
        contracted = CONTRACTED_AXES.get(names[-2], 1) if leaf == "kernel" else 1
        return MuonDimensionNumbers(tuple(range(lead, lead + contracted)),
                                    tuple(range(lead + contracted, x.ndim)))

    return jax.tree_util.tree_map_with_path(
        dims, tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def scale_to_rms(rms: float):
    """Each matrix's update times rms * sqrt(max(fan_in, fan_out)): an orthogonal update's
    RMS is 1 / sqrt(max(fan_in, fan_out)), so the result's is `rms`."""
    def scale(updates, params=None):
        def one(u, d):
            if not isinstance(d, MuonDimensionNumbers):
                return u
            fan_in = math.prod(u.shape[a] for a in d.reduction_axis)
            fan_out = math.prod(u.shape[a] for a in d.output_axis)
            return u * (rms * math.sqrt(max(fan_in, fan_out)))
        return jax.tree.map(one, updates, muon_dimensions(updates),
                            is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return optax.stateless(scale)


# ---- the optimizers -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdamW:
    """optax.adamw's settings; weight decay (decoupled) on matmul kernels only."""

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self):
        check_number("optim", "b1", self.b1, float, low=0, high=1, high_open=True)
        check_number("optim", "b2", self.b2, float, low=0, high=1, high_open=True)
        check_number("optim", "eps", self.eps, float, low=0)
        check_number("optim", "weight_decay", self.weight_decay, float, low=0)


def adamw(s: AdamW, schedule):
    return optax.adamw(schedule, b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay,
                       mask=decay_mask)


@dataclasses.dataclass(frozen=True)
class Muon(AdamW):
    """Muon's momentum (muon_beta) and update RMS (muon_rms), beside AdamW's settings for
    the params Muon leaves to it (weight_decay serves both)."""

    muon_beta: float = 0.95
    muon_rms: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        check_number("optim", "muon_beta", self.muon_beta, float, low=0, high=1,
                     high_open=True)
        check_number("optim", "muon_rms", self.muon_rms, float, low=0, low_open=True)


def muon(s: Muon, schedule):
    """Muon (Jordan et al. 2024) on the blocks' matrices: Nesterov momentum (muon_beta),
    orthogonalised by optax's Newton-Schulz iteration, scaled to an RMS of muon_rms x
    sqrt(max(fan_in, fan_out)) (Liu et al. 2025: AdamW's update size, so AdamW's learning
    rate and weight decay carry over) and decayed decoupled; AdamW on the rest."""
    is_muon = lambda x: isinstance(x, MuonDimensionNumbers)  # noqa: E731

    def labels(params):
        return jax.tree.map(lambda d: "muon" if is_muon(d) else "adamw",
                            muon_dimensions(params), is_leaf=lambda d: d is None or is_muon(d))

    matrices = optax.chain(
        scale_by_muon(beta=s.muon_beta, weight_dimension_numbers=muon_dimensions),
        scale_to_rms(s.muon_rms),
        optax.add_decayed_weights(s.weight_decay),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adamw": adamw(s, schedule)}, labels)


@dataclasses.dataclass(frozen=True)
class Lion:
    """optax.lion's settings (Chen et al. 2023, optax's defaults): the update is the sign of
    b1's blend of momentum and gradient, b2 the momentum's own decay; weight decay
    (decoupled) on matmul kernels only. Each entry of its update is +-lr, so its lr is
    usually 3-10x below AdamW's and its weight_decay as much above."""

    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 1e-3

    def __post_init__(self):
        check_number("optim", "b1", self.b1, float, low=0, high=1, high_open=True)
        check_number("optim", "b2", self.b2, float, low=0, high=1, high_open=True)
        check_number("optim", "weight_decay", self.weight_decay, float, low=0)


def lion(s: Lion, schedule):
    return optax.lion(schedule, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=decay_mask)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One optimizer (optim.name). settings: its frozen settings class (each field an
    optim.<field> key, with its default and checks); build(settings, schedule) -> the
    optax transformation, clipped and guarded by make_optimizer."""

    settings: type
    build: Callable

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.settings))

    def settings_from(self, cfg: OptimConfig):
        """Its settings from cfg's keys (None: the default); another optimizer's setting is
        refused in one line unless it holds that optimizer's default."""
        for key in setting_keys():
            value = getattr(cfg, key)
            if key in self.keys() or value is None:
                continue
            owners = {n: e for n, e in OPTIMIZERS.items() if key in e.keys()}
            if not any(value == getattr(e.settings(), key) for e in owners.values()):
                raise ConfigError(
                    f"optim.{key}={value!r} is a setting of optim.name={'|'.join(owners)}, not "
                    f"of {cfg.name} (whose settings are {', '.join(self.keys())}); drop it")
        return self.settings(**{k: getattr(cfg, k) for k in self.keys()
                                if getattr(cfg, k) is not None})


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(AdamW, adamw),
    "muon": Optimizer(Muon, muon),
    "lion": Optimizer(Lion, lion),
}


def setting_keys() -> tuple[str, ...]:
    """Every optimizer's setting keys, in table order."""
    return tuple(dict.fromkeys(k for e in OPTIMIZERS.values() for k in e.keys()))


def make_optimizer(cfg: OptimConfig, model: ModelConfig, total_steps: int):
    """chain(clip_by_global_norm, the optimizer of cfg.name), wrapped in apply_if_finite:
    a step whose gradients hold a NaN or Inf leaves params and optimizer state unchanged.
    The loop stops the run after cfg.max_skips consecutive skips (apply_if_finite itself
    never gives up here)."""
    schedule = learning_rate_schedule(cfg, model, total_steps)
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    parts.append(OPTIMIZERS[cfg.name].build(cfg.settings, schedule))
    return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30), schedule
