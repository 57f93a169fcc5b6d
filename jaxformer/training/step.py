"""The train state (a pytree) and the jitted train and eval steps."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxformer.model import Transformer


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # int32 [], optimizer steps taken (skipped ones included)
    params: Any
    opt_state: Any
    rng: jax.Array        # uint32 [2], dropout randomness; folded with the step each step


def init_state(model: Transformer, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """Fresh params and optimizer state, built inside jit."""
    def init(key):
        init_key, rng = jax.random.split(key)
        tokens = jnp.zeros((1, min(8, model.cfg.max_seq_len)), jnp.int32)
        params = model.init(init_key, tokens)["params"]
        return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                          opt_state=tx.init(params), rng=rng)

    return jax.jit(init)(jax.random.PRNGKey(seed))


def loss_sums(model: Transformer, params, batch, *, dropout_rng=None):
    """Summed next-token cross entropy over unmasked targets, and their count.

    batch: inputs/targets int32 [B, T], loss_mask float32 [B, T], optional positions and
    segment_ids [B, T]. Logits and the loss are float32.
    """
    deterministic = dropout_rng is None
    logits = model.apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                         segment_ids=batch.get("segment_ids"), deterministic=deterministic,
                         rngs=None if deterministic else {"dropout": dropout_rng})  # [B, T, V]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def make_train_step(model: Transformer, tx: optax.GradientTransformation, schedule, *,
                    grad_accum: int = 1):
    """A jitted step(state, batch) -> (state, metrics), donating the old state.

    With grad_accum > 1 the batch is split into that many micro-batches along the batch
    axis and their gradients summed in a lax.scan, giving the gradient of the full batch.
    """
    use_dropout = model.cfg.dropout > 0

    def grad_sums(params, micro, rng):
        def f(p):
            total, count = loss_sums(model, p, micro, dropout_rng=rng if use_dropout else None)
            return total, count
        (total, count), grads = jax.value_and_grad(f, has_aux=True)(params)
        return total, count, grads

    def step(state: TrainState, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        if grad_accum == 1:
            total, count, grads = grad_sums(state.params, batch, rng)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

            def body(carry, xs):
                i, mb = xs
                t, c, g = grad_sums(state.params, mb, jax.random.fold_in(rng, i))
                return jax.tree.map(jnp.add, carry, (t, c, g)), None

            zeros = (jnp.zeros([]), jnp.zeros([]), jax.tree.map(jnp.zeros_like, state.params))
            (total, count, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": total / count,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step - opt_state.total_notfinite),
            "skipped": jnp.logical_not(opt_state.last_finite).astype(jnp.int32),
            "consecutive_skips": opt_state.notfinite_count,
        }
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, metrics

    return jax.jit(step, donate_argnums=0)


def make_eval_step(model: Transformer):
    """A jitted eval(params, batch) -> (summed loss, token count)."""
    return jax.jit(lambda params, batch: loss_sums(model, params, batch))
