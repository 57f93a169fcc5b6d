"""Several seeds of one model trained as one program: their TrainStates stacked along a new
leading axis and the train step vmapped over them, so one compile serves every seed and
each matmul is N times wider. Seed i's params are ``seed_slice(params, i)``."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.transformer import Transformer
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import init_state, make_train_step


@functools.lru_cache(maxsize=None)
def vmapped_trainer(mcfg, optim, steps: int, ordered_positions: bool = True, objective=None):
    """(init(seeds [N]) -> N stacked TrainStates, step(states, batches) -> (states, metrics))
    for one model config: jitted once, whatever the number of seeds; every batch and metric
    carries the seed axis first. ordered_positions: as the Transformer's; objective: None
    (the LM's loss) or a hashable one of training/objectives.py (MLM)."""
    model = Transformer(mcfg, ordered_positions=ordered_positions)
    tx, schedule = make_optimizer(optim, mcfg, steps)
    step = make_train_step(model, tx, schedule, grad_accum=optim.grad_accum, objective=objective)
    init = jax.jit(jax.vmap(lambda seed: init_state(model, tx, seed)))
    return init, jax.jit(jax.vmap(step), donate_argnums=0)


def seed_slice(tree, i: int):
    """Seed i's part of a stacked pytree (params, states, metrics)."""
    return jax.tree.map(lambda x: x[i], tree)


def stack(trees):
    """Pytrees of NumPy/JAX arrays (one per seed) as one, each leaf [N, ...]."""
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def train_seeds(mcfg, optim, steps: int, seeds, batch, *, log_every: int, log,
                ordered_positions: bool = True, objective=None):
    """Trains one model per seed, all at once: (stacked params, each seed's mean train loss
    over the last log interval).

    batch(seed, step) -> that seed's batch at that step (a dict of NumPy arrays).
    """
    init, step_fn = vmapped_trainer(mcfg, optim, steps, ordered_positions, objective)
    state = init(jnp.asarray(seeds, jnp.int32))
    recent, t0 = [], time.perf_counter()
    for step in range(steps):
        state, metrics = step_fn(state, stack([batch(seed, step) for seed in seeds]))
        recent.append(metrics["loss"])  # [N]
        if (step + 1) % log_every == 0 or step + 1 == steps:
            losses, recent = np.mean(jax.device_get(recent), axis=0), []
            log(f"    step {step + 1}/{steps}  loss {'  '.join(f'{x:.3f}' for x in losses)}"
                f"  ({time.perf_counter() - t0:.0f} s)")
    return state.params, [float(x) for x in losses]
