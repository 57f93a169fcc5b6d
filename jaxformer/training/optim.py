"""AdamW (no decay on norms, biases and embeddings), learning-rate schedules, clipping,
and skipping of non-finite steps, all from optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxformer.config import ModelConfig
from jaxformer.training.config import OptimConfig


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


def make_optimizer(cfg: OptimConfig, model: ModelConfig, total_steps: int):
    """chain(clip_by_global_norm, adamw), wrapped in apply_if_finite: a step whose gradients
    hold a NaN or Inf leaves params and optimizer state unchanged. The loop stops the run
    after cfg.max_skips consecutive skips (apply_if_finite itself never gives up here)."""
    schedule = learning_rate_schedule(cfg, model, total_steps)
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30), schedule
