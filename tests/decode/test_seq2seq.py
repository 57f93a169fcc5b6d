"""Decoding an encoder-decoder: the KV-cached decoder (cross keys and values cached once)
against the full forward token by token, and beam search with GNMT's length penalty
against brute force over every sequence of a tiny vocabulary."""

import itertools

import jax
import numpy as np
import pytest

from jaxformer.decode.seq2seq import seq2seq_beam_search, seq2seq_generate
from jaxformer.model.encoder_decoder import EncoderDecoder
from tests.model.test_encoder_decoder import config, random_params

BOS, EOS, PAD = 2, 1, 0


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ragged_source(rng, b, s, v):
    lengths = rng.integers(1, s + 1, b)
    lengths[0] = s
    return rng.integers(0, v, (b, s)).astype(np.int32), lengths.astype(np.int32)


def distinct_lengths_source(rng, b, s, v):
    """Source [b, s] of random ids with lengths [b] a draw of b distinct values in 1..s
    (b <= s): no two rows share a padding mask."""
    lengths = rng.permutation(np.arange(1, s + 1))[:b]
    return rng.integers(0, v, (b, s)).astype(np.int32), lengths.astype(np.int32)


def full_logprobs(model, params, source, lengths, targets):
    """log-softmax of the full forward over [BOS, targets[:-1]], source padding masked."""
    segments = (np.arange(source.shape[1])[None] < lengths[:, None]).astype(np.int32)
    inputs = np.concatenate([np.full((len(targets), 1), BOS), targets[:, :-1]], 1)
    return np_log_softmax(jax.jit(model.apply)({"params": params}, source, inputs,
                                               source_segment_ids=segments))


@pytest.mark.parametrize("position, block", [("rope", "pre_ln"), ("sinusoidal", "post_ln"),
                                             ("alibi", "sandwich")])
def test_cached_decoding_equals_the_full_forward(position, block, rng):
    """Greedy and sampled targets of a ragged source batch: each token's log-prob (and,
    greedy, the token itself) is the full forward's at that step."""
    cfg = config(position=position, block=block, n_layers=2, encoder_layers=2, n_heads=4,
                 n_kv_heads=2, attention_impl="auto")
    params = random_params(cfg, rng, std=0.15)
    model = EncoderDecoder(cfg)
    source, lengths = ragged_source(rng, 4, 6, cfg.vocab_size)
    for temperature in (0.0, 1.0):
        out = seq2seq_generate(model, params, source, source_lengths=lengths, bos_id=BOS,
                               max_new_tokens=7, temperature=temperature,
                               rng=jax.random.key(int(rng.integers(1 << 30))))
        tokens = np.asarray(out.tokens)
        logp = full_logprobs(model, params, source, lengths, tokens)
        want = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
        np.testing.assert_allclose(out.logprobs, want, rtol=1e-4, atol=1e-4)
        if temperature == 0.0:
            np.testing.assert_array_equal(tokens, logp.argmax(-1))


def test_beam_search_equals_brute_force_over_every_sequence(rng):
    """V = 5, 3 new tokens: with beam_width = V^3 nothing is pruned, so the best beam by
    sum of log-probs / ((5 + length) / 6)^alpha must be the brute-force best over all V^3
    sequences (with an EOS, each cut after its first EOS, the EOS counted in its length;
    without, all of length 3, so that every row's best beam is scored at its later steps
    too); on rows whose sources all differ in length, so that a beam which reads another
    row's padding is found: with 6 rows of 125 beams laid out row-major, the first beam of
    rows 1, 2, 4 and 5 would read rows 5, 4, 2, 1 were the padding tiled, not repeated."""
    v, n, alpha = 5, 3, 0.6
    cfg = config(vocab_size=v, position="rope", n_layers=2)
    params = random_params(cfg, rng, std=0.5)
    model = EncoderDecoder(cfg)
    source, lengths = distinct_lengths_source(rng, 6, 6, v)
    seqs = np.asarray(list(itertools.product(range(v), repeat=n)), np.int32)  # [V^n, n]
    logp = full_logprobs(model, params, np.repeat(source, len(seqs), 0),
                         np.repeat(lengths, len(seqs)), np.tile(seqs, (len(source), 1)))
    steps = np.take_along_axis(logp, np.tile(seqs, (len(source), 1))[..., None], -1)[..., 0]
    steps = steps.reshape(len(source), len(seqs), n)  # [B, V^n, n]: row r's sequences
    for eos in (EOS, None):
        beams = seq2seq_beam_search(model, params, source, source_lengths=lengths, bos_id=BOS,
                                    eos_id=eos, pad_id=PAD, max_new_tokens=n,
                                    beam_width=v ** n, alpha=alpha)
        ended = np.cumsum(seqs == eos, 1) - (seqs == eos) > 0  # after the first EOS
        length = n - ended.sum(1)
        for r in range(len(source)):
            score = np.where(ended, 0.0, steps[r]).sum(1) / ((5.0 + length) / 6.0) ** alpha
            best = int(score.argmax())
            np.testing.assert_array_equal(beams.tokens[r],
                                          np.where(ended[best], PAD, seqs[best]))
            assert int(beams.lengths[r]) == length[best]
            assert float(beams.scores[r]) == pytest.approx(score[best], rel=1e-4, abs=1e-5)


def test_beam_width_1_is_greedy(rng):
    cfg = config(position="rope")
    params = random_params(cfg, rng, std=0.3)
    model = EncoderDecoder(cfg)
    source, lengths = ragged_source(rng, 3, 5, cfg.vocab_size)
    greedy = seq2seq_generate(model, params, source, source_lengths=lengths, bos_id=BOS,
                              max_new_tokens=5)
    beams = seq2seq_beam_search(model, params, source, source_lengths=lengths, bos_id=BOS,
                                max_new_tokens=5, beam_width=1)
    np.testing.assert_array_equal(beams.tokens, greedy.tokens)
