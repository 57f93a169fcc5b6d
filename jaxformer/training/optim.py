"""The optimizers (optim.name): AdamW (no decay on norms, biases and embeddings), or Muon
on the blocks' matrices beside AdamW on the rest; learning-rate schedules, clipping, and
skipping of non-finite steps, all from optax."""

from __future__ import annotations

import dataclasses
import math

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
SCHEDULES = ("cosine", "inverse_sqrt", "constant", "linear")
OPTIMIZERS = ("adamw", "muon")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer (name: adamw, or muon on the blocks' matrices with AdamW on the rest:
    jaxformer.training.optim) with a learning-rate schedule, global-norm clipping and
    gradient accumulation. muon_beta: Muon's momentum; muon_rms: its updates' RMS per
    sqrt(max(fan_in, fan_out)) (0.2 matches AdamW's, so lr and weight_decay serve both).

    schedule: cosine (linear warmup, cosine decay to lr * min_lr_ratio), linear (warmup,
    linear decay to lr * min_lr_ratio), constant (warmup, then lr), inverse_sqrt
    (lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): Vaswani et al. with lr = 1).
    label_smoothing: the target distribution (1 - e) one-hot + e / vocab (optax's
    smooth_labels; Vaswani et al.'s 0.1), in the encoder-decoder's loss.
    """

    name: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    grad_accum: int = 1
    max_skips: int = 5  # consecutive non-finite steps before the run stops
    muon_beta: float = 0.95
    muon_rms: float = 0.2
    label_smoothing: float = 0.0

    def __post_init__(self):
        o = "optim"
        check_number(o, "label_smoothing", self.label_smoothing, float, low=0, high=1,
                     high_open=True)
        check_choice(o, "name", self.name, OPTIMIZERS)
        check_number(o, "muon_beta", self.muon_beta, float, low=0, high=1, high_open=True)
        check_number(o, "muon_rms", self.muon_rms, float, low=0, low_open=True)
        check_number(o, "lr", self.lr, float, low=0, low_open=True)
        check_choice(o, "schedule", self.schedule, SCHEDULES)
        check_number(o, "warmup_steps", self.warmup_steps, int, low=0)
        if self.schedule == "inverse_sqrt" and self.warmup_steps < 1:
            raise ConfigError("optim.warmup_steps must be >= 1 for schedule=inverse_sqrt")
        check_number(o, "min_lr_ratio", self.min_lr_ratio, float, low=0, high=1)
        check_number(o, "b1", self.b1, float, low=0, high=1, high_open=True)
        check_number(o, "b2", self.b2, float, low=0, high=1, high_open=True)
        check_number(o, "eps", self.eps, float, low=0)
        check_number(o, "weight_decay", self.weight_decay, float, low=0)
        check_number(o, "clip_norm", self.clip_norm, float, low=0, low_open=True, optional=True)
        check_number(o, "grad_accum", self.grad_accum, int, low=1)
        check_number(o, "max_skips", self.max_skips, int, low=1)


def inverse_sqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
    """Vaswani et al. (2017): scale * d^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Optimizer step 0 is the paper's step 1 (the paper's formula is undefined at 0).
    """
    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

    return schedule


def learning_rate_schedule(cfg: OptimConfig, model: ModelConfig, total_steps: int):
    warmup, peak = cfg.warmup_steps, cfg.lr
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(model.d_model, warmup, peak)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1),
                                                  end)
    decay = (optax.constant_schedule(peak) if cfg.schedule == "constant" else
             optax.linear_schedule(peak, end, max(total_steps - warmup, 1)))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


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


def muon(cfg: OptimConfig, schedule):
    """Muon (Jordan et al. 2024) on the blocks' matrices: Nesterov momentum (muon_beta),
    orthogonalised by optax's Newton-Schulz iteration, scaled to an RMS of muon_rms x
    sqrt(max(fan_in, fan_out)) (Liu et al. 2025: AdamW's update size, so AdamW's learning
    rate and weight decay carry over) and decayed decoupled; AdamW on the rest."""
    is_muon = lambda x: isinstance(x, MuonDimensionNumbers)  # noqa: E731

    def labels(params):
        return jax.tree.map(lambda d: "muon" if is_muon(d) else "adamw",
                            muon_dimensions(params), is_leaf=lambda d: d is None or is_muon(d))

    matrices = optax.chain(
        scale_by_muon(beta=cfg.muon_beta, weight_dimension_numbers=muon_dimensions),
        scale_to_rms(cfg.muon_rms),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule))
    rest = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.partition({"muon": matrices, "adamw": rest}, labels)


def make_optimizer(cfg: OptimConfig, model: ModelConfig, total_steps: int):
    """chain(clip_by_global_norm, the optimizer: adamw or muon), wrapped in apply_if_finite:
    a step whose gradients hold a NaN or Inf leaves params and optimizer state unchanged.
    The loop stops the run after cfg.max_skips consecutive skips (apply_if_finite itself
    never gives up here)."""
    schedule = learning_rate_schedule(cfg, model, total_steps)
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    if cfg.name == "muon":
        parts.append(muon(cfg, schedule))
    else:
        parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30), schedule
