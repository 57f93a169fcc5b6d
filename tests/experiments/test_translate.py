"""jaxformer.experiments.translate's functions without a training run (the run that learns
to translate is tests/training/test_seq2seq_training.py's): val_pairs cuts a dataset's val
records into (source, target) pairs in order; decode_pairs on a tiny random encoder-decoder,
greedy, in padded batches with a partial last one, equals greedy decoding written out step
by step with the model's full forward of each source alone (every token the argmax of the
logits after the tokens before it, decoding stopped at the end id), and its beam search
returns targets cut before the end id."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.data.completions import Records
from jaxformer.experiments.translate import decode_pairs, val_pairs
from jaxformer.model.encoder_decoder import EncoderDecoder

V, END = 13, 12


def records(rng, n, low, high):
    lengths = rng.integers(low, high + 1, n)
    tokens = rng.integers(0, END, int(lengths.sum())).astype(np.int32)
    return Records(tokens, np.ones(len(tokens), np.uint8),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


class Data:
    def __init__(self, val):
        self.val = val


def test_val_pairs_are_the_val_records_in_order(rng):
    n = int(rng.integers(1, 9))
    sources, targets = records(rng, n, 1, 6), records(rng, n, 0, 4)
    want = [(sources.tokens[sources.offsets[i]:sources.offsets[i + 1]],
             targets.tokens[targets.offsets[i]:targets.offsets[i + 1]]) for i in range(n)]
    for limit in (None, 1, n, n + 3):
        got = val_pairs(Data((sources, targets)), limit)
        assert len(got) == (n if limit is None else min(limit, n))
        for (s, t), (ws, wt) in zip(got, want):
            np.testing.assert_array_equal(s, ws)
            np.testing.assert_array_equal(t, wt)


@pytest.fixture
def tiny(rng):
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=V, d_model=16, n_heads=2, n_layers=1,
                      encoder_layers=1, max_seq_len=16)
    model = EncoderDecoder(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    # random weights of a visible size: logits far apart, so greedy picks are clear
    params = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
                          params)
    return model, params


def test_greedy_decode_pairs_equal_full_forward_steps(rng, tiny):
    model, params = tiny
    pairs = [(rng.integers(0, END, int(rng.choice([2, 5]))).astype(np.int32), None)
             for _ in range(5)]
    steps = 6
    got = decode_pairs(model, params, pairs, END, beam_width=1, alpha=0.0, greedy=True,
                       batch_size=2, max_new_tokens=steps)
    assert len(got) == len(pairs)
    forward = jax.jit(lambda s, t: model.apply({"params": params}, s, t))
    clear = 0
    for (source, _), out in zip(pairs, got):
        assert END not in out and len(out) <= steps
        # the start (the end id too), the tokens, the end unless cut at steps; the decoder
        # is causal, so one forward of the whole target gives every step's logits
        target = [END, *out] + ([END] if len(out) < steps else [])
        logits = np.asarray(forward(source[None], np.asarray([target + [0] * (
            steps + 2 - len(target))], np.int32)))[0]
        for i, token in enumerate(target[1:]):  # each the argmax after those before it
            row = logits[i]
            assert row[token] >= row.max() - 1e-4, (source, target, i, row)
            clear += np.sort(row)[-2] < row[token] - 1e-3
    assert clear >= len(pairs)  # not all near ties


def test_beam_decode_pairs_cut_before_the_end_id(rng, tiny):
    model, params = tiny
    pairs = [(rng.integers(0, END, int(rng.integers(1, 7))).astype(np.int32), None)
             for _ in range(3)]
    got = decode_pairs(model, params, pairs, END, beam_width=2, alpha=0.6, greedy=False,
                       batch_size=4, max_new_tokens=5)
    assert len(got) == 3 and all(END not in g and len(g) <= 5 for g in got)
