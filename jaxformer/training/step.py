"""The train state (a pytree) and the jitted train and eval steps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer.attention.ring import zigzag_batch
from jaxformer.core.logprobs import target_logprobs
from jaxformer.core.sharding import (batch_sharding, constrain, logical_axes, sequence_split,
                                     shardings_for, traced_under)
from jaxformer.model import lora
from jaxformer.model.mtp import rebalanced_all
from jaxformer.model.transformer import Transformer
from jaxformer.moe import balancing
from jaxformer.training.sweep import member_losses, members, sweep_params, sweep_specs


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # int32 [], optimizer steps taken (skipped ones included)
    params: Any
    opt_state: Any
    rng: jax.Array        # uint32 [2], dropout randomness; folded with the step each step


def _init_fn(model: Transformer, tx: optax.GradientTransformation):
    sweep = members(model) > 1  # several LoRA adapters side by side (training/sweep.py)

    def init(key):
        init_key, rng = jax.random.split(key)
        tokens = jnp.zeros((1, min(8, model.cfg.max_seq_len)), jnp.int32)
        params = (sweep_params(model, init_key, tokens) if sweep
                  else model.init(init_key, tokens)["params"])
        trained = trained_part(params)[0]
        return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                          opt_state=jax.vmap(tx.init)(trained) if sweep else tx.init(trained),
                          rng=rng)
    return init


def trained_part(params):
    """(trained, frozen): with LoRA adapters in the model, the adapters and the frozen
    base (jaxformer.model.lora.partition); else all the params and nothing. The optimizer
    holds state for the trained part only."""
    adapters, base = lora.partition(params)
    return (adapters, base) if adapters else (params, {})


def joined(trained, frozen):
    """The params tree again from trained_part's two halves."""
    return lora.combine(trained, frozen) if frozen else trained


def abstract_state(model: Transformer, tx: optax.GradientTransformation) -> TrainState:
    """The TrainState's shapes and dtypes (jax.ShapeDtypeStructs): nothing is allocated."""
    return jax.eval_shape(_init_fn(model, tx), jax.random.PRNGKey(0))


def state_shardings(model: Transformer, tx: optax.GradientTransformation, mesh, rules):
    """NamedShardings of a TrainState: params by their logical names and `rules`, the
    optimizer's per-param moments like their params, scalars replicated."""
    abstract = abstract_state(model, tx)
    specs = logical_axes(model)
    params = shardings_for(sweep_specs(specs) if members(model) > 1 else specs,
                           abstract.params, mesh, rules)
    replicated = NamedSharding(mesh, P())
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 (optax.partition's)
    opt_state = optax.tree_utils.tree_map_params(
        tx, lambda x, s: x if masked(x) else s, abstract.opt_state, trained_part(params)[0],
        transform_non_params=lambda _: replicated, is_leaf=masked)
    return TrainState(step=replicated, params=params, opt_state=opt_state, rng=replicated)


def init_state(model: Transformer, tx: optax.GradientTransformation, seed: int, *,
               mesh=None, rules=None, shardings=None) -> TrainState:
    """Fresh params and optimizer state, built inside jit. With a mesh they are born
    sharded (jit out_shardings; `shardings`: state_shardings, if already at hand): no
    device ever holds the whole model."""
    init, key = _init_fn(model, tx), jax.random.PRNGKey(seed)
    if mesh is None:
        return jax.jit(init)(key)
    shardings = shardings or state_shardings(model, tx, mesh, rules)
    return jax.jit(traced_under(mesh, rules, init), out_shardings=shardings)(key)


def logits_of(model: Transformer, params, batch, dropout_rng=None, sown: bool = False):
    """(logits float32 [B, T, V], the batch they are of) and, with sown, the "moe"
    collection the sparse layers sow. With the sequence split over a mesh axis (context
    parallelism) the rows are put in zigzag order first (jaxformer.attention.ring.zigzag_batch):
    the returned batch is in that order, so sums over a row are the same."""
    deterministic = dropout_rng is None
    split = sequence_split()
    if split is not None:  # context parallelism: every device gets equal causal work
        batch = zigzag_batch(batch, split[0].shape[split[1]])
    out = model.apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                      segment_ids=batch.get("segment_ids"), deterministic=deterministic,
                      rngs=None if deterministic else {"dropout": dropout_rng},
                      mutable=["moe"] if sown else False)
    return (out[0], batch, out[1]) if sown else (out, batch)


def loss_terms(model: Transformer, params, batch, *, dropout_rng=None):
    """(summed next-token cross entropy over unmasked targets, their count, the sparse
    layers' statistics (training/balancing.py; {} for a dense model)).

    batch: inputs/targets int32 [B, T], loss_mask float32 [B, T], optional positions and
    segment_ids [B, T]. Logits and the loss are float32 (logits_of).
    """
    sparse = any(model.cfg.sparse_layers)  # the MoE layers sow their statistics
    logits, batch, *sown = logits_of(model, params, batch, dropout_rng, sown=sparse)  # [B, T, V]
    sown = sown[0] if sown else None
    nll = -target_logprobs(logits, batch["targets"])  # [B, T]: the cross entropy (optax's)
    mask = batch["loss_mask"].astype(jnp.float32)
    stats = balancing.layer_stats(model.cfg, sown["moe"]) if sparse else {}
    return jnp.sum(nll * mask), jnp.sum(mask), stats


def loss_sums(model: Transformer, params, batch, *, dropout_rng=None, terms=loss_terms):
    """The summed train loss and the token count: the summed cross entropy (terms: loss_terms
    or one like it, e.g. the chunked loss's) plus count x the MoE balancing penalty
    (model.moe.aux_loss x the mean over sparse layers of aux + z_loss x the mean of z), so
    that the loss per token is the mean cross entropy plus the penalty. A dense model's is
    the cross entropy alone."""
    total, count, stats = terms(model, params, batch, dropout_rng=dropout_rng)
    return total + count * balancing.penalty(model.cfg.moe, stats), count


def gradient_sums(model: Transformer, trained, frozen, batch, rng, terms=loss_terms):
    """(summed cross entropy, token count, gradient of the summed train loss, MoE sums
    (balancing.step_sums; {} for a dense model)) with respect to the trained part alone (a
    frozen base gets none); a sweep's losses are [S], each member's gradient its own
    loss's (the members share no trained param; sweeps refuse MoE models). terms:
    loss_terms or one like it (loss_sums)."""
    dropout_rng = rng if model.cfg.dropout > 0 else None

    if members(model) == 1:
        def loss(t):
            total, count, stats = terms(model, joined(t, frozen), batch,
                                        dropout_rng=dropout_rng)
            train_total = total + count * balancing.penalty(model.cfg.moe, stats)
            return train_total, (total, count, balancing.step_sums(stats, count))
        (_, (total, count, sums)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return total, count, grads, sums

    def summed(t):
        totals, count = member_losses(lambda p: loss_sums(
            model, p, batch, dropout_rng=dropout_rng, terms=terms), t, frozen)  # [S]
        return jnp.sum(totals), (totals, count)
    (_, (total, count)), grads = jax.value_and_grad(summed, has_aux=True)(trained)
    return total, count, grads, {}


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """objective.name=lm: the step's hooks (gradient_sums, eval_sums, metrics: the
    interface every objective's hooks share, training/objectives) for the next-token loss
    above, with MoE balancing and LoRA sweeps; hashable by value. micro_batches: the
    step's (optim.grad_accum), which moe_dropped is averaged over."""

    micro_batches: int = 1

    def token_terms(self, model, params, batch, *, dropout_rng=None):
        """(summed cross entropy, its count, the sparse layers' stats): loss_terms here."""
        return loss_terms(model, params, batch, dropout_rng=dropout_rng)

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        return gradient_sums(model, trained, frozen, batch, rng, self.token_terms)

    def eval_sums(self, model, params, batch, reference=None):
        """(summed cross entropy ([S] for a sweep), token count), without MoE penalties."""
        if members(model) > 1:
            return member_losses(lambda p: loss_sums(model, p, batch, terms=self.token_terms),
                                 *trained_part(params))
        return self.token_terms(model, params, batch)[:2]

    def metrics(self, sums, count) -> dict:
        """The MoE layers' metrics (balancing.step_metrics; {} for a dense model)."""
        return balancing.step_metrics(sums, count, self.micro_batches)


def batch_sums(sums, trained, frozen, batch, rng, grad_accum: int):
    """sums(trained, frozen, batch, rng) (gradient_sums, or an objective's) over the whole
    batch: with grad_accum > 1, of its micro-batches in a lax.scan, added up (micro-batch
    i takes rows i, i + grad_accum, ...: each device keeps its own rows; its dropout key
    is rng folded with i)."""
    if grad_accum == 1:
        return sums(trained, frozen, batch, rng)
    micro = jax.tree.map(lambda x: jnp.swapaxes(
        x.reshape(-1, grad_accum, *x.shape[1:]), 0, 1), batch)  # [A, B / A, T]

    def body(carry, xs):
        i, mb = xs
        mb = jax.tree.map(lambda x: constrain(x, "act_batch", "act_seq"), mb)
        out = sums(trained, frozen, mb, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, carry, out), None

    shapes = jax.eval_shape(lambda mb: sums(trained, frozen, mb, rng),
                            jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))[0]


def make_train_step(model: Transformer, tx: optax.GradientTransformation, schedule, *,
                    grad_accum: int = 1, mesh=None, rules=None, shardings=None,
                    objective=None, reference=None):
    """A jitted step(state, batch) -> (state, metrics), donating the old state.

    With grad_accum > 1 the batch is split into that many micro-batches along the batch
    axis and their gradients summed in a lax.scan, giving the gradient of the full batch.
    Micro-batch i takes rows i, i + grad_accum, ...: each device keeps its own rows.
    With a mesh, the step is traced under its rules; `shardings` (state_shardings) pins the
    state's layout in and out, and batches are split over data x fsdp.

    With MoE layers the gradient is the train loss's (loss_sums: the cross entropy plus the
    balancing penalties); metrics' loss stays the cross entropy, and moe_aux, moe_z,
    moe_load and moe_dropped join it (balancing.step_metrics). With model.moe.
    bias_update_rate > 0, every sparse layer's (and MTP block's) score_bias then becomes
    balanced_bias(its value before, the load summed over the micro-batches, the rate).

    objective: the step's hooks (training/objectives: an entry's build), whose
    gradient_sums and metrics the step calls; None: LanguageModel(grad_accum), the
    language model's loss above. reference: the frozen params it compares with, or None
    (passed to every step as an argument, not baked into the program as a constant).
    """
    sweep, cfg = members(model) > 1, model.cfg
    objective = LanguageModel(grad_accum) if objective is None else objective

    def step(state: TrainState, batch, *reference):
        rng = jax.random.fold_in(state.rng, state.step)
        trained, frozen = trained_part(state.params)
        sums_of = functools.partial(objective.gradient_sums, model,
                                    reference=(reference or [None])[0])
        total, count, grads, sums = batch_sums(sums_of, trained, frozen, batch, rng, grad_accum)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        update, norm = (jax.vmap(tx.update), jax.vmap(optax.tree.norm)) if sweep else \
            (tx.update, optax.tree.norm)  # a sweep: each member's own update
        updates, opt_state = update(grads, state.opt_state, trained)
        params = joined(optax.apply_updates(trained, updates), frozen)
        if sums and cfg.moe.bias_update_rate > 0:  # DeepSeek-V3's balancing, outside the gradient
            params = rebalanced_all(cfg, params, state.params, sums["load"], opt_state.last_finite)
        metrics = {  # each [S] for a sweep
            "loss": total / count,  # the cross entropy alone: the MoE penalties apart
            "grad_norm": norm(grads),
            "lr": schedule(state.step - opt_state.total_notfinite),
            "skipped": jnp.logical_not(opt_state.last_finite).astype(jnp.int32),
            "consecutive_skips": opt_state.notfinite_count,
            **objective.metrics(sums, count),
        }
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, metrics

    extra = () if reference is None else (reference,)
    if mesh is None:
        jitted = jax.jit(step, donate_argnums=0)
    else:
        jitted = jax.jit(traced_under(mesh, rules, step), donate_argnums=0,
                         in_shardings=(shardings, batch_sharding(mesh, rules)) + (
                             (shardings.params,) if extra else ()),
                         out_shardings=(shardings, NamedSharding(mesh, P())))
    return (lambda state, batch: jitted(state, batch, *extra)) if extra else jitted


def make_eval_step(model: Transformer, *, mesh=None, rules=None, param_shardings=None,
                   objective=None, reference=None):
    """A jitted eval(params, batch) -> the objective's eval_sums: (its summed loss, its
    count, and its metrics' sums where it has metrics). objective None: LanguageModel's,
    (summed cross entropy ([S] for a sweep), token count) without MoE balancing penalties."""
    objective = LanguageModel() if objective is None else objective

    def evaluate(params, batch, *reference):
        return objective.eval_sums(model, params, batch, *reference)

    extra = () if reference is None else (reference,)
    if mesh is None:
        jitted = jax.jit(evaluate)
    else:
        jitted = jax.jit(traced_under(mesh, rules, evaluate),
                         in_shardings=(param_shardings, batch_sharding(mesh, rules)) + (
                             (param_shardings,) if extra else ()),
                         out_shardings=NamedSharding(mesh, P()))
    return (lambda params, batch: jitted(params, batch, *extra)) if extra else jitted
