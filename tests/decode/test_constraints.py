"""jaxformer.decode.constraints against transformers' logits processors of the same meaning, and
the decoders' outputs under constraints (greedy and beams: what each constraint asks
holds). Greedy decoding under constraints against transformers' generate:
tests/hf/test_bart.py (an encoder-decoder), tests/convert/test_convert.py (GPT-2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import beam_search, generate
from jaxformer.decode.constraints import Constraints, constrain
from jaxformer.decode.seq2seq import seq2seq_beam_search, seq2seq_generate
from jaxformer.model.encoder_decoder import EncoderDecoder

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def test_constrain_is_transformers_logits_processors():
    """On random rows over a vocabulary of 5 (so that n-grams recur), each row at its own
    length, constrain equals transformers' MinNewTokensLength, NoRepeatNGram, ForcedBOS and
    ForcedEOS processors, applied in generate's order to that row."""
    torch = pytest.importorskip("torch", reason="the interop extra")
    tp = pytest.importorskip("transformers", reason="the interop extra")
    v, rows, seen = 5, 6, {"banned": 0, "forced": 0}
    for _ in range(40):
        prompt, new = int(rng.integers(1, 5)), int(rng.integers(2, 9))
        c = Constraints(int(rng.integers(0, 4)), int(rng.integers(0, 4)),
                        int(rng.integers(v)) if rng.random() < 0.5 else None,
                        int(rng.integers(v)) if rng.random() < 0.5 else None)
        eos = int(rng.integers(v))
        steps = rng.integers(0, new, rows)  # each row's new tokens so far
        history = rng.integers(0, v, (rows, 12))  # one width: each op compiles once
        scores = rng.normal(size=(rows, v)).astype(np.float32)
        for step in np.unique(steps):  # constrain takes one step for the batch
            got = np.asarray(constrain(jnp.asarray(scores), c, int(step), new, eos,
                                       jnp.asarray(history), jnp.asarray(prompt + steps)))
            for r in np.flatnonzero(steps == step):
                processors = [tp.MinNewTokensLengthLogitsProcessor(prompt, c.min_new_tokens, eos)]
                if c.no_repeat_ngram_size:
                    processors.append(tp.NoRepeatNGramLogitsProcessor(c.no_repeat_ngram_size))
                if c.forced_bos_id is not None and prompt == 1:  # transformers': at length 1
                    processors.append(tp.ForcedBOSTokenLogitsProcessor(c.forced_bos_id))
                if c.forced_eos_id is not None:
                    processors.append(tp.ForcedEOSTokenLogitsProcessor(prompt + new,
                                                                       c.forced_eos_id))
                ids = torch.tensor(history[r:r + 1, :prompt + step])
                want = torch.tensor(scores[r:r + 1])
                for p in processors:
                    want = p(ids, want)
                want = want.numpy()[0]
                if c.forced_bos_id is not None and prompt > 1 and step == 0:
                    want = np.where(np.arange(v) == c.forced_bos_id, 0.0, -np.inf)
                np.testing.assert_array_equal(got[r], want)
                seen["banned"] += int(np.isinf(want).any() and not (want == 0).any())
                seen["forced"] += int((want == 0).sum() == 1 and np.isinf(want).sum() == v - 1)
    assert min(seen.values()) >= 10, seen  # both kinds occurred


def ngrams(row, n):
    return [tuple(row[i:i + n]) for i in range(len(row) - n + 1)]


def check_tokens(prefix, tokens, c: Constraints, eos, pad):
    """prefix (the prompt, or an encoder-decoder's BOS), then each row's tokens up to its
    EOS: the forced first token; no EOS before min_new_tokens, the forced EOS last at the
    latest; every later new token completes no n-gram that the tokens before it hold."""
    n = c.no_repeat_ngram_size
    for before, row in zip(prefix, np.asarray(tokens)):
        ended = np.flatnonzero(row == eos)
        assert ended.size and (row[ended[0] + 1:] == pad).all()
        assert ended[0] >= c.min_new_tokens and row[0] == c.forced_bos_id
        seq = [*before, *row[:ended[0] + 1]]
        for i in range(len(before) + 1, len(seq)):
            assert tuple(seq[i - n + 1:i + 1]) not in ngrams(seq[:i], n), (i, seq)


@pytest.fixture(scope="module")
def decoder():
    cfg = ModelConfig(vocab_size=12, d_model=32, n_layers=1, n_heads=4, d_ff=64,
                      max_seq_len=48)  # one layer (per stack): what is checked is the decoders'
    model = Transformer(cfg)
    return model, jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]


def test_decoders_under_constraints_emit_what_they_ask(decoder):
    """A random 12-token model, greedy, sampled and beam search (prompts of their own
    lengths), and an encoder-decoder's greedy and beams: no bigram twice (the prompt's
    included), no EOS before the 6th new token, the first token forced and the last EOS."""
    model, params = decoder
    c = Constraints(min_new_tokens=5, no_repeat_ngram_size=2, forced_bos_id=3, forced_eos_id=0)
    eos, pad, new = 0, 11, 14
    prompts = rng.integers(1, 12, (4, 6))
    lengths = np.array([6, 3, 5, 1])
    prefixes = [p[:n] for p, n in zip(prompts, lengths)]
    kw = dict(max_new_tokens=new, eos_id=eos, pad_id=pad, prompt_lengths=lengths)
    for run in (lambda **k: generate(model, params, prompts, rng=jax.random.key(0),
                                     temperature=0, **k),
                lambda **k: generate(model, params, prompts, rng=jax.random.key(2),
                                     temperature=1.5, **k),
                lambda **k: beam_search(model, params, prompts, beam_width=3, **k)):
        check_tokens(prefixes, run(constraints=c, **kw).tokens, c, eos, pad)

    s2s = EncoderDecoder(model.cfg.replace(arch="encoder_decoder"))
    p2 = jax.jit(s2s.init)(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"]
    source = rng.integers(1, 12, (3, 5))
    kw = dict(bos_id=7, max_new_tokens=new, eos_id=eos, pad_id=pad)
    for run in (seq2seq_generate, lambda *a, **k: seq2seq_beam_search(*a, beam_width=3, **k)):
        check_tokens([[7]] * 3, run(s2s, p2, source, constraints=c, **kw).tokens, c, eos, pad)


def test_a_folders_generation_config_and_what_it_cannot_say(tmp_path):
    """generation_constraints reads transformers' names (a forced id as an int or a list of
    one; min_new_tokens); a decoder-only model's min_length (it counts the prompt) and two
    forced EOS ids are refused in one line naming what to give instead."""
    from jaxformer.convert import generation_constraints
    cfg = ModelConfig(vocab_size=12, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
    file = tmp_path / "generation_config.json"
    assert generation_constraints(tmp_path, cfg) == Constraints()  # no file: none
    file.write_text('{"min_new_tokens": 3, "no_repeat_ngram_size": 4, "forced_eos_token_id": '
                    '[2], "forced_bos_token_id": null, "num_beams": 4}')
    assert generation_constraints(tmp_path, cfg) == Constraints(3, 4, None, 2)
    file.write_text('{"min_length": 20}')
    with pytest.raises(ValueError, match="counts the prompt; give min_new_tokens"):
        generation_constraints(tmp_path, cfg)
    assert generation_constraints(tmp_path, cfg.replace(arch="encoder_decoder")) == \
        Constraints(min_new_tokens=19)
    file.write_text('{"forced_eos_token_id": [1, 2]}')
    with pytest.raises(ValueError, match=r"forced_eos_token_id=\[1, 2\] names 2 tokens"):
        generation_constraints(tmp_path, cfg)
    file.write_text('{"min_length": 20,')
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        generation_constraints(tmp_path, cfg)
