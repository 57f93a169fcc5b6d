"""objective.name=grpo: the GRPO training step (the loss: jaxformer.training.grpo).

Each step (train.steps counts them) takes train.batch_size prompts of the run's
prompt/completion records (drawn as a pure function of (train.seed, step); the record's
completion is the reference answer task:exact compares with) and

1. rollout (jaxformer.decode.loops.generate, the KV-cached sampler): group_size completions
   per prompt at objective.temperature, up to objective.max_new_tokens (stopping at the
   tokenizer's end of text), with their log-probs;
2. reward: each completion scored (jaxformer.training.rewards);
3. update (the state donated): the reference's token log-probs (skipped when
   objective.beta = 0), each group's advantages, then objective.inner_steps optimizer
   steps of grpo_loss in a lax.scan, the rollout's log-probs the old policy (so at the
   first inner step the ratio is 1: ratio_first).

A task reward (task:NAME) has its targets before the rollout, so with a byte-level
tokenizer (jaxformer.training.match) the three stages are one jitted program on the run's
mesh. A Python reward (MODULE:FUNCTION) runs on the host between two jitted programs,
rollout and update, whose times are logged (rollout_s, reward_s, update_s);
bench/posttrain.py measures both forms. The lr schedule runs over train.steps x
inner_steps optimizer updates. On a mesh the params keep their shardings; the rollouts
are replicated (every device computes every sequence), not split.

objective.rollout (ROLLOUTS) says where the rollout runs: "generate" (the default) as
above, inside the jitted step with a task reward; "engine" through the serving engine
(jaxformer.serve.Engine: continuous batching over a paged KV cache, a group's shared
prompt pages held once) on the host before the jitted program(s), so a short completion
frees its slot instead of waiting for the longest, and the rollout ends with its longest
completion, not at max_new_tokens. One engine for the run (rollout_engine), its weights
swapped each step (Engine.use_params: programs and pool kept, the prefix pages the old
policy computed forgotten); pages of one token, each group's first row submitted first,
so the group's other rows hold its prompt's pages and skip the prefill. Its log-probs
are the model's log-softmax, as generate's; greedy rollouts (temperature 0) give
generate's tokens, so the same run. A step with it logs rollout_s, its engine time.
bench/grpo_rollout.py times a rollout-heavy step both ways.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer.core.sharding import traced_under
from jaxformer.decode.loops import generate
from jaxformer.model.config import ConfigError
from jaxformer.model.lora import base_only
from jaxformer.serve.engine import Engine, RequestSettings
from jaxformer.training.chunked_loss import chunked_terms, token_logps
from jaxformer.training.grpo import group_advantages, grpo_loss
from jaxformer.training.match import byte_table, encode_targets, task_rewards, token_pieces
from jaxformer.training.optim import make_optimizer
from jaxformer.training.rewards import Reward
from jaxformer.training.step import joined, loss_terms, trained_part


def record_prompts(records, eot_id):
    """(prompts, answers): each record's prompt token ids and its completion's (without
    the end of text), as lists of int32 arrays."""
    prompts, answers = [], []
    for i in range(len(records)):
        s, e = records.offsets[i], records.offsets[i + 1]
        ids, answer = records.tokens[s:e], records.weights[s:e].astype(bool)
        tail = ids[answer]
        prompts.append(ids[~answer])
        answers.append(tail[:-1] if eot_id is not None and len(tail) and tail[-1] == eot_id
                       else tail)
    return prompts, answers


def sequences(prompts, lengths, tokens, logps, counts):
    """The update's batch: each rollout as one row prompt + completion (right-padded):
    tokens, positions, segment_ids (1 on the sequence), loss_mask (1 on the completion's
    tokens) and old (the rollout's log-probs at those tokens). prompts [N, W] right-padded
    with lengths [N]; tokens, logps [N, M] with counts [N] valid."""
    n, w = prompts.shape
    m = tokens.shape[1]
    cols = jnp.arange(w + m)[None, :]  # [1, T]
    at = cols - lengths[:, None]  # index into the completion
    completion = (at >= 0) & (at < counts[:, None])
    safe = jnp.clip(at, 0, m - 1)
    prompt = jnp.where(cols < lengths[:, None], jnp.pad(prompts, ((0, 0), (0, m))), 0)
    seq = jnp.where(completion, jnp.take_along_axis(tokens, safe, 1), prompt)
    live = cols < (lengths + counts)[:, None]
    return {"tokens": seq.astype(jnp.int32),
            "positions": jnp.broadcast_to(cols, seq.shape).astype(jnp.int32),
            "segment_ids": live.astype(jnp.int32), "loss_mask": completion.astype(jnp.float32),
            "old": jnp.where(completion, jnp.take_along_axis(logps, safe, 1), 0.0).astype(
                jnp.float32)}


def reward_stats(rewards, counts, group_size):
    """The rollout's logged numbers: reward mean, within-group std, completion length."""
    return {"reward_mean": jnp.mean(rewards),
            "reward_std": jnp.mean(jnp.std(rewards.reshape(-1, group_size), axis=1)),
            "completion_len": jnp.mean(counts.astype(jnp.float32))}


ROLLOUT_PAGE = 1  # the engine's page size: a group's later completions share its prompt whole


def rollout_engine(rollouts, params, slots: int):
    """The Rollouts' one serving engine, serving `params`: made at its first rollout, its
    weights swapped at each later one (use_params: the compiled programs and the page pool
    kept, the prefix pages the old weights computed forgotten). Pages of one token
    (ROLLOUT_PAGE): every prompt token but the last is a full page, so the completions
    after a prompt's first hold its pages and start decoding without a prefill. The pool
    holds every slot's longest prompt and max_new_tokens (no row is ever short of pages),
    not max_seq_len per slot."""
    if rollouts.engine is None:
        longest = rollouts.width + rollouts.o.max_new_tokens
        rollouts.engine = Engine(
            rollouts.model, params, slots=slots, mesh=rollouts.mesh, page_size=ROLLOUT_PAGE,
            pages=max(slots * longest, -(-rollouts.model.cfg.max_seq_len // ROLLOUT_PAGE)),
            prefill_chunk=max(16, 1 << (rollouts.width - 1).bit_length()))
    else:
        rollouts.engine.use_params(params)
    return rollouts.engine


def firsts_first(prompts, lengths):
    """The rows [N] in the order they are submitted: each run of equal prompts' first row
    (a group's first completion: its prompt's prefill), then the others in order (each
    holding its group's prompt pages once the first has computed them)."""
    same = np.all(prompts[1:] == prompts[:-1], axis=1) & (lengths[1:] == lengths[:-1])
    return np.argsort(np.concatenate([[False], same]), kind="stable")


def engine_rollout(rollouts, params, prompts, lengths, key):
    """(tokens int32 [N, M], log-probs [N, M], counts [N]) of the prompts [N, W] (lengths
    [N]) continued through the Rollouts' serving engine of N slots (rollout_engine), each
    row's seed drawn from `key`; zeros past each row's count (the update masks them)."""
    o, n, m = rollouts.o, len(lengths), rollouts.o.max_new_tokens
    engine = rollout_engine(rollouts, params, n)
    eot = rollouts.tokenizer.eot_id
    seeds = np.asarray(jax.random.randint(key, (n,), 0, 2**31 - 1))
    row = {engine.submit(prompts[r, :lengths[r]].tolist(), RequestSettings(
        max_tokens=m, temperature=o.temperature, seed=int(seeds[r]),
        stop_token_ids=() if eot is None else (eot,))): int(r)
        for r in firsts_first(prompts, lengths)}
    tokens, logps = np.zeros((n, m), np.int32), np.zeros((n, m), np.float32)
    counts = np.zeros(n, np.int32)
    while engine.has_work():
        for e in engine.step():
            r = row[e.request_id]
            tokens[r, counts[r]], logps[r, counts[r]] = e.token, e.logprob
            counts[r] += 1
    return tokens, logps, counts


def generate_rollout(rollouts, params, prompts, lengths, key):
    """generate's rollout, fetched to the host (the Python reward's form)."""
    return tuple(np.asarray(x) for x in jax.device_get(
        rollouts.rollout(params, prompts, lengths, key)))


class Rollout(NamedTuple):
    """objective.rollout: `host` makes a step's (tokens, logps, counts) on the host for a
    Python reward; `ahead`: also for a task reward, before its jitted program (else the
    rollout is traced inside it)."""
    host: Callable
    ahead: bool


ROLLOUTS = {"generate": Rollout(generate_rollout, ahead=False),
            "engine": Rollout(engine_rollout, ahead=True)}


class GroupPolicy:
    """objective.name=grpo. The loop calls rollout_step(...) for its train step and the
    eval step's eval_sums (the val records' completion loss, as objective.name=lm)."""

    def __init__(self, cfg):  # cfg: the RunConfig
        self.cfg, self.o = cfg, cfg.objective
        self.chunk = cfg.train.loss_chunk  # the log-probs through the head in blocks
        self.reward = Reward(self.o.reward)  # a bad reward: refused before data loads

    def eval_sums(self, model, params, batch, reference=None):
        if self.chunk:
            return chunked_terms(model, params, batch, self.chunk)[:2]
        return loss_terms(model, params, batch)[:2]

    def rollout_step(self, model, data, reference, mesh=None, rules=None, shardings=None):
        """step(state, step_index) -> (state, metrics) for the loop."""
        return Rollouts(self, model, data, reference, mesh, rules, shardings)

    def update_fn(self, model, tx, schedule, num_groups):
        """update(state, rollout, *reference) -> (state, metrics, the rollout's reward_stats
        among them), to be jitted; rollout: prompts, lengths, tokens, logps, counts (as
        `sequences` takes them) and rewards."""
        o, logps = self.o, functools.partial(token_logps, chunk=self.chunk)

        def update(state, rollout, *reference):
            trained, frozen = trained_part(state.params)
            batch = sequences(*(rollout[k] for k in ("prompts", "lengths", "tokens", "logps",
                                                     "counts")))
            args = (batch["tokens"], batch["positions"], batch["segment_ids"])
            ref = None
            if o.beta:  # the init_from weights, or (LoRA) the base without its adapters
                ref_params = reference[0] if reference else base_only(state.params)
                ref = jax.lax.stop_gradient(logps(model, ref_params, *args))
            group = jnp.arange(rollout["rewards"].shape[0]) // o.group_size
            adv = group_advantages(rollout["rewards"], group, num_groups)

            def inner(carry, i):
                trained, opt_state = carry

                def loss(t):
                    new = logps(model, joined(t, frozen), *args)
                    return grpo_loss(new, batch["old"], ref, batch["loss_mask"], adv,
                                     clip=o.clip, clip_high=o.clip_high, beta=o.beta)
                (value, m), grads = jax.value_and_grad(loss, has_aux=True)(trained)
                updates, opt_state = tx.update(grads, opt_state, trained)
                m.update(loss=value, grad_norm=optax.tree.norm(grads),
                         skipped=jnp.logical_not(opt_state.last_finite).astype(jnp.int32),
                         consecutive_skips=opt_state.notfinite_count,
                         lr=schedule(state.step * o.inner_steps + i - opt_state.total_notfinite))
                return (optax.apply_updates(trained, updates), opt_state), m

            (trained, opt_state), ms = jax.lax.scan(inner, (trained, state.opt_state),
                                                    jnp.arange(o.inner_steps))
            metrics = {k: ms[k][-1] for k in ("grad_norm", "consecutive_skips", "lr")}
            metrics.update(loss=ms["loss"][0], ratio_first=ms["ratio_mean"][0],
                           ratio_mean=jnp.mean(ms["ratio_mean"]), skipped=jnp.max(ms["skipped"]),
                           clip_fraction=jnp.mean(ms["clip_fraction"]), kl=ms["kl"][0])
            metrics.update(reward_stats(rollout["rewards"], rollout["counts"], o.group_size))
            new = state.replace(step=state.step + 1, params=joined(trained, frozen),
                                opt_state=opt_state)
            return new, metrics
        return update


class Rollouts:
    """The loop's train step for GRPO: rollout, reward, update (the module docstring)."""

    def __init__(self, policy, model, data, reference, mesh, rules, shardings):
        cfg, o = policy.cfg, policy.o
        self.policy, self.model, self.o, self.seed = policy, model, o, cfg.train.seed
        self.mesh, self.kind = mesh, ROLLOUTS[o.rollout]
        self.engine = None  # objective.rollout=engine's, made at the first rollout
        self.batch_size, self.tokenizer = cfg.train.batch_size, data.tokenizer
        self.prompts, self.answers = record_prompts(data.train, data.tokenizer.eot_id)
        if not self.prompts:
            raise ConfigError(f"{data.source}: no training records to take prompts from")
        self.width = max(len(p) for p in self.prompts)
        if self.width + o.max_new_tokens > cfg.model.max_seq_len:
            raise ConfigError(f"the longest prompt ({self.width} tokens) + objective."
                              f"max_new_tokens={o.max_new_tokens} exceeds model.max_seq_len="
                              f"{cfg.model.max_seq_len}; lower max_new_tokens or shorten prompts")
        pieces = token_pieces(data.tokenizer) if policy.reward.target else None
        self.fused = pieces is not None  # one program: a task reward on token ids
        if self.fused:  # on the devices once, not sent each step
            self.table, self.table_lengths = jax.device_put(
                byte_table(pieces), None if mesh is None else NamedSharding(mesh, P()))
        # the optimizer again, its schedule over every inner update (same state layout)
        tx, schedule = make_optimizer(cfg.optim, cfg.model, cfg.train.steps * o.inner_steps)
        update = policy.update_fn(model, tx, schedule, self.batch_size)
        self.extra = () if reference is None else (reference,)
        fn = self.one_program(update) if self.fused else update
        if mesh is None:
            self.step_fn = jax.jit(fn, donate_argnums=0)
        else:
            everywhere = NamedSharding(mesh, P())
            self.step_fn = jax.jit(traced_under(mesh, rules, fn), donate_argnums=0,
                                   in_shardings=(shardings, everywhere) + (
                                       (shardings.params,) if self.extra else ()),
                                   out_shardings=(shardings, everywhere))

    def rollout(self, params, prompts, lengths, key):
        """generate's (tokens, log-probs, counts) for the step's prompts."""
        o = self.o
        out = generate(self.model, params, prompts, prompt_lengths=lengths,
                       max_new_tokens=o.max_new_tokens, temperature=o.temperature, rng=key,
                       eos_id=self.tokenizer.eot_id)
        return out.tokens, out.logprobs, out.lengths

    def one_program(self, update):
        """step(state, batch, *reference): rollout, task reward, update, as one function."""
        def step(state, batch, *reference):
            made = batch.get("made")  # the rollout made before the step (objective.rollout)
            tokens, logps, counts = made if made is not None else self.rollout(
                state.params, batch["prompts"], batch["lengths"], batch["key"])
            rewards = task_rewards(tokens, counts, batch["table"], batch["table_lengths"],
                                   self.tokenizer.eot_id, batch["target"], batch["target_len"])
            rollout = dict(prompts=batch["prompts"], lengths=batch["lengths"], tokens=tokens,
                           logps=logps, counts=counts, rewards=rewards)
            return update(state, rollout, *reference)
        return step

    def batch(self, step):
        """(prompts int32 [N, W] right-padded, lengths [N], picked record ids [N]) of step's
        rollouts: each picked prompt group_size times in a row."""
        picked = np.random.default_rng([self.seed, step]).integers(
            0, len(self.prompts), self.batch_size)
        rows = np.repeat(picked, self.o.group_size)
        prompts = np.zeros((len(rows), self.width), np.int32)
        lengths = np.array([len(self.prompts[i]) for i in rows], np.int32)
        for r, i in enumerate(rows):
            prompts[r, :lengths[r]] = self.prompts[i]
        return prompts, lengths, rows

    def texts(self, rows):
        """(prompt texts, answer texts) of records `rows`."""
        decode = self.tokenizer.decode
        return ([decode(self.prompts[i].tolist()) for i in rows],
                [decode(self.answers[i].tolist()) for i in rows])

    def completion_texts(self, tokens, counts):
        eot = self.tokenizer.eot_id
        texts = []
        for row, n in zip(tokens, counts):
            ids = row[:int(n)].tolist()
            texts.append(self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eot else ids))
        return texts

    def __call__(self, state, step):
        prompts, lengths, rows = self.batch(step)
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        if self.fused:
            texts, answers = self.texts(rows[::self.o.group_size])
            width = self.o.max_new_tokens * self.table.shape[1]
            target, target_len = encode_targets(
                [self.policy.reward.target(p, a) for p, a in zip(texts, answers)], width)
            batch = dict(prompts=prompts, lengths=lengths, key=key, table=self.table,
                         table_lengths=self.table_lengths,
                         target=np.repeat(target, self.o.group_size, axis=0),
                         target_len=np.repeat(target_len, self.o.group_size))
            if self.kind.ahead:
                return self.ahead(state, batch)
            return self.step_fn(state, batch, *self.extra)
        return self.hosted(state, prompts, lengths, rows, key)

    def ahead(self, state, batch):
        """The task reward's step with the rollout made first (objective.rollout=engine)."""
        t0 = time.perf_counter()
        batch["made"] = self.kind.host(self, state.params, batch["prompts"], batch["lengths"],
                                       batch["key"])
        rollout_s = time.perf_counter() - t0
        state, m = self.step_fn(state, batch, *self.extra)
        return state, {**m, "rollout_s": rollout_s}

    def hosted(self, state, prompts, lengths, rows, key):
        """The step with a Python reward: rollout (jitted), reward (host), update (jitted)."""
        o, t0 = self.o, time.perf_counter()
        tokens, logps, counts = self.kind.host(self, state.params, prompts, lengths, key)
        t1 = time.perf_counter()
        texts, answers = self.texts(rows)
        rewards = np.asarray(self.policy.reward(texts, self.completion_texts(tokens, counts),
                                                answers), np.float32)
        t2 = time.perf_counter()
        rollout = dict(prompts=prompts, lengths=lengths, tokens=tokens, logps=logps,
                       counts=counts, rewards=rewards)
        state, m = self.step_fn(state, rollout, *self.extra)
        m = jax.device_get(m)
        t3 = time.perf_counter()
        made = float(np.sum(counts))  # completion tokens sampled (and trained on)
        m.update(rollout_s=t1 - t0, reward_s=t2 - t1, update_s=t3 - t2,
                 rollout_tokens_per_s=made / (t1 - t0),
                 update_tokens_per_s=made * o.inner_steps / (t3 - t2))
        return state, m
