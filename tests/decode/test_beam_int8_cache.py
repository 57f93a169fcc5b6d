"""Beam search over the int8 KV cache (beam_search(..., cache_dtype="int8")): the best
beam's score is the log-probability of its tokens under a full forward whose cached keys
and values pass through the int8 fake quantisation (tests/decode/test_int8_cache.py's),
not under the float cache's; an encoder-decoder's beam of width 1 over an int8 cache is
greedy decoding over one. Fresh random weights and prompts every run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Transformer
from jaxformer.decode import beam_search
from jaxformer.decode.seq2seq import seq2seq_beam_search, seq2seq_generate
from jaxformer.model.encoder_decoder import EncoderDecoder
from tests.attention.test_cache_formats import config, np_quantised
from tests.decode.test_int8_cache import reference_run
from tests.model.test_encoder_decoder import config as seq2seq_config

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
NAMES = tuple(f"blocks.{i}.attn.{h}" for i in range(2) for h in ("hook_rot_k", "hook_v"))


def make(seed, n_layers: int = 2):
    """tests/attention/test_cache_formats' tiny GQA model and sharp random params, its init
    jitted (one program, not one per op)."""
    cfg = config(n_layers)
    init = jax.jit(Transformer(cfg.replace(attention_impl="reference")).init)
    params = init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    return Transformer(cfg), jax.tree.map(lambda x: x * 3.0, params)


def near_tie(raw, within: float = 2e-4) -> bool:
    """Whether a value of raw [..., H] lies `within` int8 steps of a rounding tie: two
    programs' float32 keys differ by ~1e-4 steps (a cached and a full forward's: 1.3e-4
    in 9 of 10 draws), so there the beam's program may round it the other way (in 3 of
    100 draws it did, moving a beam's score by up to 2e-3; a tie within 1e-5 in each)."""
    x = np.asarray(raw, np.float64)
    steps = x / np.maximum(np_quantised(x)[1], 1e-30)
    return bool((np.abs(steps - np.floor(steps) - 0.5) < within).any())


def summed_logprobs(logits, tokens, width: int):
    """float64 [B]: the summed log-softmax of tokens[:, width:] from logits [B, T, V]
    (position t's logits predict token t + 1)."""
    x = np.asarray(logits, np.float64)[:, width - 1:-1]  # [B, N, V]
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(tokens)[:, width:, None], -1)[..., 0]
    return picked.sum(-1)


def test_int8_cache_beams_score_on_the_fake_quantised_forward():
    """Beams of width 3 over an int8 cache, length_penalty 0 (the score: the plain sum of
    log-probs): the best beam's score equals its tokens' summed log-probs under the full
    forward with fake-quantised keys and values, within float32 rounding."""
    for _ in range(8):  # ~3 in 10 draws hold a value at a tie: drawn again
        model, params = make(int(rng.integers(1 << 30)))
        prompts = jnp.asarray(rng.integers(1, 37, (2, 5)), jnp.int32)
        beams = beam_search(model, params, prompts, beam_width=3, max_new_tokens=4,
                            length_penalty=0.0, cache_dtype="int8")
        tokens = jnp.concatenate([prompts, beams.tokens], axis=1)  # [B, 9]
        logits, raw = reference_run(model, params, tokens, NAMES)
        if not any(near_tie(raw[n]) for n in NAMES):
            break
    else:
        pytest.fail("every draw had a key or value at a rounding tie")
    want = summed_logprobs(logits, tokens, prompts.shape[1])
    np.testing.assert_allclose(np.asarray(beams.scores), want, rtol=1e-5, atol=1e-4)


def test_a_bad_beam_cache_dtype_is_refused_in_one_line():
    """Refused before anything runs (no params needed), naming the formats."""
    with pytest.raises(ValueError, match="cache_dtype='int4' is not a KV cache format"):
        beam_search(Transformer(config(1)), None, np.ones((1, 3), np.int32), beam_width=2,
                    max_new_tokens=2, cache_dtype="int4")


def test_seq2seq_beam_of_width_one_is_greedy_over_the_int8_cache():
    """seq2seq_beam_search(beam_width=1, alpha=0: the plain sum) over an int8 cache gives
    seq2seq_generate's greedy tokens over one, its score their summed log-probs."""
    cfg = seq2seq_config(n_heads=4, n_kv_heads=2, position="rope")
    model = EncoderDecoder(cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                            jnp.zeros((1, 2), jnp.int32))["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray((path[-1].key == "scale") + rng.normal(0, 0.5, x.shape),
                                   np.float32), shapes)
    source = rng.integers(3, cfg.vocab_size, (2, 5)).astype(np.int32)
    kw = dict(bos_id=2, max_new_tokens=4, cache_dtype="int8")
    greedy = seq2seq_generate(model, params, source, **kw)
    beams = seq2seq_beam_search(model, params, source, beam_width=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(np.asarray(beams.tokens), np.asarray(greedy.tokens))
    np.testing.assert_allclose(np.asarray(beams.scores),
                               np.asarray(greedy.logprobs, np.float64).sum(-1), rtol=1e-5,
                               atol=1e-5)
