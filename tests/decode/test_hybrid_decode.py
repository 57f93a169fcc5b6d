"""Decoding hybrids (recurrent layers beside attention with a sliding window, so the
cache holds states beside rings), for every recurrent row of MIXERS, against full
forwards: greedy generate, sampled log-probs, the n-gram ban, beam search with the states
reordered with the beams; speculative decoding refused in one line. A row whose module is
not built yet is skipped. Every reference runs one compiled full forward per mixer
(forward_of: [3, W + N] tokens)."""

import functools

import jax
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import beam_search, generate
from jaxformer.decode.constraints import Constraints
from tests.conftest import np_log_softmax
from tests.decode.test_loops import beam_by_recompute
from tests.model.test_mixers import RECURRENT, built_yet, hybrid, random_params

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V = 8  # a small vocabulary: beams overtake each other and n-grams repeat
W, N = 7, 6  # the prompts' width (longer than the window), tokens generated


def decoder(mixer: str):
    """A hybrid [mixer, attention with a window of 4, mixer] (a recurrent layer first and
    last) and its random params, as tests/model/test_mixers draws them; skipped if it is
    not built."""
    if not built_yet(mixer):
        pytest.skip(f"model.mixer.{mixer}'s module is not built yet (NotImplementedError)")
    cfg = hybrid(mixer, vocab_size=V, n_layers=3, layer_pattern=["r", "a"],
                 layer_kinds={"r": {"mixer": mixer}, "a": {"window": 4}})
    return Transformer(cfg), random_params(cfg, rng)


@functools.lru_cache(maxsize=None)
def forward_of(cfg: ModelConfig):
    """The model's full forward, jitted once per config (a fresh jax.jit per call would
    compile again)."""
    return jax.jit(Transformer(cfg).apply)


def prompts_of():
    """Three right-padded prompts (one full width), random tokens in the padding too."""
    lengths = np.array([W, *rng.integers(1, W, 2)], np.int32)
    return rng.integers(0, V, (3, W)).astype(np.int32), lengths


def greedy_rollout(model, params, prompts, lengths, ngram: int = 0):
    """Each row's argmax continuation by a full forward per token (no cache), the tokens
    completing an n-gram the row already holds banned when ngram > 0."""
    b = len(prompts)
    buf = np.zeros((b, W + N), np.int32)  # the tokens after a row's last: causal, unread
    for r in range(b):
        buf[r, :lengths[r]] = prompts[r, :lengths[r]]
    forward = forward_of(model.cfg)
    for i in range(N):
        logits = np.asarray(forward({"params": params}, buf))
        for r in range(b):
            end = lengths[r] + i
            scores = logits[r, end - 1].copy()
            seen = buf[r, :end]
            for j in range(end - ngram + 1) if ngram else ():
                if (seen[j:j + ngram - 1] == seen[end - ngram + 1:]).all():
                    scores[seen[j + ngram - 1]] = -np.inf
            buf[r, end] = int(np.argmax(scores))
    return np.stack([buf[r, lengths[r]:lengths[r] + N] for r in range(b)])


def continuation_logprobs(model, params, prompts, lengths, tokens):
    """float64 log p(token) of each row's generated `tokens` [3, N] after its prompt, from
    one full forward over prompt + continuation [3, W + N]."""
    seqs = np.zeros((len(prompts), W + N), np.int32)
    for r, n in enumerate(lengths):
        seqs[r, :n + N] = np.concatenate([prompts[r, :n], tokens[r]])
    logp = np_log_softmax(forward_of(model.cfg)({"params": params}, seqs))
    return np.stack([logp[r, n - 1 + np.arange(N), tokens[r]] for r, n in enumerate(lengths)])


@pytest.mark.parametrize("mixer", RECURRENT)
def test_generate_is_the_full_forwards_argmax_or_sample(mixer):
    """Prompts of three lengths in one batch (greedy and sampled decoding: one compiled
    decoder). Greedy: each row's argmax continuation by full forwards, with the full
    forward's log-probs. Sampling (temperature 1.3, top-k 5) differs between keys, and
    each token's log-prob is the full forward's over the row's sampled history.
    Constraints(no_repeat_ngram_size=2) over 8 tokens (a repeat is likely): greedy is the
    full forward's argmax with each bigram the row holds banned."""
    model, params = decoder(mixer)
    prompts, lengths = prompts_of()
    kw = dict(prompt_lengths=lengths, max_new_tokens=N)
    greedy = generate(model, params, prompts, rng=jax.random.key(0), temperature=0.0, **kw)
    np.testing.assert_array_equal(greedy.tokens, greedy_rollout(model, params, prompts,
                                                                lengths))
    runs = [generate(model, params, prompts, rng=jax.random.key(int(rng.integers(1 << 30))),
                     temperature=1.3, top_k=5, **kw) for _ in range(2)]
    assert (np.asarray(runs[0].tokens) != np.asarray(runs[1].tokens)).any()
    for out in (greedy, *runs):
        np.testing.assert_allclose(out.logprobs, continuation_logprobs(
            model, params, prompts, lengths, np.asarray(out.tokens)), rtol=1e-4, atol=1e-5)
    out = generate(model, params, prompts, rng=jax.random.key(0), temperature=0.0,
                   constraints=Constraints(no_repeat_ngram_size=2), **kw)
    np.testing.assert_array_equal(out.tokens, greedy_rollout(model, params, prompts, lengths,
                                                             ngram=2))


@pytest.mark.parametrize("mixer", RECURRENT)
def test_beam_search_reorders_the_states_with_the_beams(mixer):
    """3 beams over 8 tokens for 6 steps (beams overtake each other, so a beam's state
    must come from its parent), prompts of three lengths: each row's best beam and score
    are those of beam search by its definition with a full forward per step."""
    model, params = decoder(mixer)
    prompts, lengths = prompts_of()
    beams = beam_search(model, params, prompts, prompt_lengths=lengths, beam_width=3,
                        max_new_tokens=N, length_penalty=0.0)
    forward = functools.partial(forward_of(model.cfg), {"params": params})  # [3, W + N]
    for r in range(3):
        tokens, score, _ = beam_by_recompute(forward, prompts[r, :lengths[r]], v=V, k=3, n=N,
                                             length_penalty=0.0, eos_id=None, pad_id=0,
                                             width=W)
        np.testing.assert_array_equal(beams.tokens[r], tokens, err_msg=f"row {r}")
        assert float(beams.scores[r]) == pytest.approx(score, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("mixer", RECURRENT)
def test_speculative_decoding_of_a_recurrent_model_is_refused(mixer):
    """Refused drafts are taken back by emptying cache slots, which a state cannot do: a
    hybrid model (prompt lookup) or a hybrid draft is refused in one line naming it."""
    cfg = hybrid(mixer, vocab_size=V)
    attending = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2,
                            max_seq_len=cfg.max_seq_len)
    prompts = np.ones((1, 3), np.int32)
    for target, draft, whose in (
            (cfg, "prompt_lookup", "the model"),
            (attending, (Transformer(cfg), {}), "the draft model")):
        with pytest.raises(ValueError, match=f"{whose}'s recurrent layers \\({mixer}\\)") as e:
            generate(Transformer(target), {}, prompts, max_new_tokens=2, rng=jax.random.key(0),
                     draft=draft)
        assert "\n" not in str(e.value)
