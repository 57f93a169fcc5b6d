"""GRPO's rollouts through the serving engine (jaxformer.training.grpo_step.engine_rollout)
against generate: one engine serves the run, its weights swapped each step
(Engine.use_params), and a prompt whose pages were cached under the old weights gets the
new weights' greedy tokens; a group's rows, sharing their prompt's pages, each get
generate's tokens and log-probs. One tiny model; its programs compile once per process."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.serve import Engine, RequestSettings
from jaxformer.training.grpo_step import engine_rollout, firsts_first

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="rope")
W, N, EOT = 13, 10, 3  # the widest prompt, the most new tokens, the end of text


@functools.cache
def initial():
    """The model's init, once per process."""
    return jax.jit(Transformer(CFG).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def weights():
    """Init with its matrices moved by N(0, 0.15) drawn afresh (confident, varied)."""
    return jax.tree.map(lambda x: x + 0.15 * rng.standard_normal(x.shape, np.float32)
                        if x.ndim >= 2 else x, initial()["params"])


def greedy(params, prompts, lengths, eos_id=None):
    """generate's greedy (tokens, log-probs, counts) of prompts [B, W] (lengths [B])."""
    out = generate(Transformer(CFG), params, prompts, prompt_lengths=lengths,
                   max_new_tokens=N, rng=jax.random.key(0), temperature=0.0, eos_id=eos_id)
    return tuple(np.asarray(x) for x in jax.device_get((out.tokens, out.logprobs,
                                                        out.lengths)))


def drain(engine, prompt):
    """The engine's greedy tokens for the prompt alone, N of them."""
    engine.submit(prompt, RequestSettings(max_tokens=N, temperature=0.0))
    tokens = []
    while engine.has_work():
        tokens += [e.token for e in engine.step()]
    return tokens


def test_new_weights_are_served_even_for_a_prompt_cached_under_the_old():
    """After use_params(new), a prompt whose three full pages the old weights computed
    (and the prefix cache holds) gets generate's greedy tokens under the new weights; a
    stale page read would give the old weights' keys."""
    old, new = weights(), weights()
    prompt = rng.integers(4, CFG.vocab_size, W).tolist()
    padded = np.array([prompt], np.int32)
    want_old, want_new = (greedy(p, padded, np.array([W]))[0][0].tolist() for p in (old, new))
    assert want_old != want_new  # the two weights disagree on this prompt
    engine = Engine(Transformer(CFG), old, slots=2, page_size=4, prefill_chunk=16)
    assert drain(engine, prompt) == want_old
    assert engine.stats()["pages_cached"] >= 3  # the prompt's pages, kept for a later one
    engine.use_params(new)
    assert drain(engine, prompt) == want_new


def test_one_engine_serves_each_steps_weights_and_shares_each_groups_prompt():
    """Two rollouts of 3 prompts x 4 rows (each group's rows in a row, as GRPO lays them
    out) with other weights each time: the second runs on the first's engine, and every
    row gets generate's greedy tokens, log-probs (within 1e-5) and counts under its
    step's weights, stopping at the end of text; no row was ever short of pages."""
    rollouts = types.SimpleNamespace(
        o=types.SimpleNamespace(max_new_tokens=N, temperature=0.0), model=Transformer(CFG),
        mesh=None, width=W, tokenizer=types.SimpleNamespace(eot_id=EOT), engine=None)
    made = []
    for _ in range(2):
        params = weights()
        lengths = np.repeat(rng.integers(3, W + 1, 3), 4).astype(np.int32)
        prompts = np.repeat(rng.integers(4, CFG.vocab_size, (3, W)), 4, axis=0)
        prompts = np.where(np.arange(W) < lengths[:, None], prompts, 0).astype(np.int32)
        tokens, logps, counts = engine_rollout(rollouts, params, prompts, lengths,
                                               jax.random.key(0))
        made.append(rollouts.engine)
        want, want_logps, want_counts = greedy(params, prompts, lengths, eos_id=EOT)
        np.testing.assert_array_equal(counts, want_counts)
        live = np.arange(N) < counts[:, None]
        np.testing.assert_array_equal(np.where(live, tokens, -1), np.where(live, want, -1))
        np.testing.assert_allclose(logps[live], want_logps[live], atol=1e-5)
        assert rollouts.engine.stats()["preempted"] == 0  # its pool holds every row whole
    assert made[0] is made[1]


def test_each_groups_first_row_is_submitted_first():
    """firsts_first: the first row of each run of equal prompts (equal tokens and length),
    in order, then every other row in order."""
    groups = rng.integers(1, 5, 6)
    lengths = np.repeat(rng.integers(2, 6, len(groups)), groups)
    prompts = np.repeat(rng.integers(0, 50, (len(groups), 6)), groups, axis=0)
    starts = np.concatenate([[0], np.cumsum(groups)[:-1]])
    rest = [r for r in range(len(lengths)) if r not in set(starts.tolist())]
    assert firsts_first(prompts, lengths).tolist() == starts.tolist() + rest
