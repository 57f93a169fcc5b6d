"""The parity contract (jaxformer.core.logprobs): the log-probs generate returns for the tokens
it sampled equal the training forward's, teacher-forced, under every batch composition;
so GRPO's ratio of the policy to the rollout starts at 1. Fresh random weights, prompts
and samples every run; the training-side reference is also checked against float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.logprobs import token_logprobs
from jaxformer.decode import generate
from jaxformer.training.grpo import grpo_loss
from tests.conftest import np_log_softmax

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
BOUND = 1e-5  # |generate's - the training forward's| on CPU float32 (measured ~1e-6)
W, N = 6, 7   # prompt width, new tokens


@functools.cache
def initializer(cfg: ModelConfig):
    """The model's init, jitted once per config (eager, it runs op by op)."""
    return jax.jit(Transformer(cfg).init)


def make(position):
    cfg = ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=48, position=position)
    params = initializer(cfg)(jax.random.key(int(rng.integers(1 << 30))),
                              jnp.zeros((1, 4), jnp.int32))["params"]
    return Transformer(cfg), jax.tree.map(lambda x: x * 3.0, params)  # sharper than init's


def rollout(model, params):
    """Three ragged prompts and their sampled completions (temperature 1): each row's
    prompt + completion, and generate's log-probs of the completion [3, N]."""
    lengths = rng.integers(2, W + 1, 3).astype(np.int32)
    prompts = rng.integers(1, model.cfg.vocab_size, (3, W)).astype(np.int32)
    out = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=N,
                   rng=jax.random.key(int(rng.integers(1 << 30))))
    seqs = [np.concatenate([prompts[r, :lengths[r]], np.asarray(out.tokens[r])])
            for r in range(3)]
    return seqs, np.asarray(out.logprobs)


def compositions(seqs, r):
    """{name: (tokens, positions, segment_ids) [B, T], where row r's sequence sits:
    (batch row, first column)}: row r alone, among the others (right-padded, segment id
    0), padded wider, and packed behind and before other sequences (positions restart),
    then padded to the same width [1, n + 14] (one compiled forward for the last two)."""
    seq, n = seqs[r], len(seqs[r])
    arange = lambda b, t: np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))  # noqa: E731
    width = max(len(s) for s in seqs)
    batch, seg = np.zeros((3, width), np.int32), np.zeros((3, width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)], seg[i, :len(s)] = s, 1
    wide = np.zeros((1, n + 14), np.int32)
    wide[0, :n] = seq
    before, after = seqs[r - 1][:int(rng.integers(1, 10))], seqs[r - 2][:5]
    parts = [before, seq, after, np.zeros(9 - len(before), np.int32)]  # the last: padding
    packed = np.concatenate(parts)[None]  # [1, n + 14]
    return {
        "alone": ((seq[None], arange(1, n), None), (0, 0)),
        "among others": ((batch, arange(3, width), seg), (r, 0)),
        "padded wider": ((wide, arange(1, n + 14), (np.arange(n + 14) < n)[None] * 1), (0, 0)),
        "packed": ((packed, np.concatenate([np.arange(len(p)) for p in parts])[None],
                    np.concatenate([np.full(len(p), (i + 1) % 4)
                                    for i, p in enumerate(parts)])[None]),
                   (0, len(before))),
    }


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_generate_logprobs_equal_the_training_forwards(position):
    model, params = make(position)
    seqs, logprobs = rollout(model, params)
    forward = jax.jit(lambda *a: token_logprobs(model, params, *a))
    r = int(rng.integers(3))
    completion = np.arange(len(seqs[r]) - N, len(seqs[r]))  # its columns in the sequence
    measured = {}
    for name, ((tokens, positions, segments), (row, col)) in compositions(seqs, r).items():
        got = np.asarray(forward(*(None if a is None else jnp.asarray(a, jnp.int32)
                                   for a in (tokens, positions, segments))))
        teacher = got[row, col + completion]
        measured[name] = float(np.abs(teacher - logprobs[r]).max())
        if name == "alone":  # the training side against float64
            want = np_log_softmax(jax.jit(model.apply)({"params": params}, tokens))
            want = want[0, completion - 1, seqs[r][completion]]
            np.testing.assert_allclose(teacher, want, rtol=0, atol=BOUND)
        # the rollout as the old policy: GRPO's ratio is 1 within the bound, nothing clipped
        _, metrics = grpo_loss(jnp.asarray(teacher)[None], logprobs[r][None], None,
                               np.ones((1, N)), np.ones(1), clip=1e-4, clip_high=1e-4)
        assert float(metrics["clip_fraction"]) == 0.0
    print(position, measured)  # the measured bound per composition (pytest -s)
    assert max(measured.values()) < BOUND, measured


def test_segment_starts_and_padding_get_zero():
    model, params = make("rope")
    tokens = jnp.asarray(rng.integers(1, 37, (2, 9)), jnp.int32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0, 0], list(range(9))], jnp.int32)
    got = np.asarray(jax.jit(functools.partial(token_logprobs, model))(params, tokens, pos, seg))
    assert np.all(got[0, [0, 3, 7, 8]] == 0) and np.all(got[0, [1, 2, 4, 5, 6]] < 0)
    assert got[1, 0] == 0 and np.all(got[1, 1:] < 0)
