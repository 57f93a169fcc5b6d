"""model.arch=encoder: bidirectional self-attention (no causal rule) on every backend and
position scheme, against the float64 forward of tests/model/test_transformer.py and the reference
backend; what a token may see (gradients), order-blindness without positions, and the
one-line refusals (generation, causal-only schemes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.attention.backends import backends_here
from jaxformer.model.config import ConfigError
from jaxformer.positions import segment_positions
from jaxformer.positions.schemes import POSITION_SCHEMES
from tests.model.test_transformer import np_forward

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
# the schemes whose definitions need the causal rule: xPos's scales decay behind the query
# and grow ahead of it; CoPE counts gates from a key to the end of the query's row
CAUSAL_ONLY = ("xpos", "cope")


def encoder(**kw):
    base = dict(arch="encoder", vocab_size=61, d_model=32, n_layers=2, n_heads=4,
                max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def init(cfg, tokens):
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    # random norm scales and biases (not init's ones and zeros), so a misplaced one shows
    return jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)


def packed_batch():
    """Tokens, positions and segment ids of two rows: two packed documents, and one
    followed by padding (segment 0). The first documents are long enough for whole blocks
    of keys to lie after (or outside the window of) whole blocks of queries in both rows."""
    seg = np.array([[1] * 9 + [2] * 3, [1] * 9 + [0] * 3])
    tokens = rng.integers(0, 61, seg.shape)
    return tokens, np.asarray(segment_positions(jnp.asarray(seg))), seg


def logits_of(cfg, params, tokens, **kw):
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens, **kw))


@pytest.mark.parametrize("impl", [n for n in backends_here() if n != "reference"])
def test_every_backend_equals_the_reference_backend(impl, monkeypatch):
    """Each backend, given the encoder's rule (no causal rule; a symmetric window on the
    local layer), answers as the reference backend on a packed, padded batch; blockwise
    and chunked in blocks of 3, so that blocks on both sides of the diagonal are read."""
    from jaxformer.attention import blockwise, chunked
    monkeypatch.setattr(blockwise, "BLOCK_Q", 3)
    monkeypatch.setattr(blockwise, "BLOCK_K", 3)
    monkeypatch.setattr(chunked, "CHUNK", 3)
    cfg = encoder(n_kv_heads=2, layer_pattern=("local", "global"),
                  layer_kinds={"local": {"window": 3}, "global": {}})
    tokens, pos, seg = packed_batch()
    params = init(cfg, tokens)
    want = logits_of(cfg.replace(attention_impl="reference"), params, tokens, positions=pos,
                     segment_ids=seg)
    got = logits_of(cfg.replace(attention_impl=impl), params, tokens, positions=pos,
                    segment_ids=seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", list(POSITION_SCHEMES))
def test_each_scheme_matches_float64_or_is_refused(position):
    """Every position scheme runs in an encoder and matches the float64 forward with no
    causal rule (T5 with its bidirectional buckets, a symmetric window), or, where the
    scheme is defined for causal attention only, is refused in one line."""
    settings = {"t5": {"num_buckets": 8, "max_distance": 20}, "cope": {"positions": 5}}
    kw = dict(position=position, sliding_window=3 if position == "rope" else None,
              position_settings=settings.get(position))
    if position in CAUSAL_ONLY:
        with pytest.raises(ConfigError, match=f"position='{position}' is defined for causal "
                                              "attention only.*arch='encoder'") as e:
            encoder(**kw)
        assert "\n" not in str(e.value)
        return
    cfg = encoder(**kw, attention_impl="reference")
    tokens, pos, seg = packed_batch()
    params = init(cfg, tokens)
    if position == "fire":  # FIRE's threshold inside the sequence (as tests/model/test_transformer.py)
        params["position_bias"]["threshold_scale"] = jnp.float32(rng.uniform(1, 4) / 512)
    got = logits_of(cfg, params, tokens, positions=pos, segment_ids=seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], np_forward(cfg, params, tokens, pos, seg)[real],
                               rtol=2e-4, atol=2e-4)


def test_a_token_sees_its_whole_segment_and_nothing_else():
    """The output at position i has a nonzero gradient with respect to the embedding of
    every token of its own segment, those after i included, and exactly zero with respect
    to the tokens of other segments and padding."""
    cfg = encoder(tie_embeddings=False, vocab_size=16, attention_impl="blockwise")
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    tokens = rng.permutation(16)[None, :8]  # distinct: an embedding row is one position's
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    params = init(cfg, tokens)
    model = Transformer(cfg)
    w = jnp.asarray(rng.standard_normal(cfg.vocab_size), jnp.float32)

    @jax.jit
    def grad_rows(i):  # |d (w . logits[i]) / d embedding[tokens[j]]| summed over the row
        def f(table):
            p = {**params, "embed": {"embedding": table}}
            return model.apply({"params": p}, tokens, positions=pos, segment_ids=seg)[0, i] @ w
        g = jax.grad(f)(params["embed"]["embedding"])
        return jnp.abs(g[tokens[0]]).sum(-1)

    for i in range(7):
        g = np.asarray(grad_rows(i))
        same = seg[0] == seg[0, i]
        assert (g[same] > 0).all(), (i, g)
        assert (g[~same] == 0).all(), (i, g)


def test_without_positions_permuting_the_input_permutes_the_output():
    """position=none: an encoder is blind to order, so permuting a row's tokens permutes
    its outputs (float32, tight)."""
    cfg = encoder(position="none", attention_impl="reference")
    tokens = rng.integers(0, cfg.vocab_size, (2, 10))
    perm = rng.permutation(10)
    params = init(cfg, tokens)
    out = logits_of(cfg, params, tokens)
    np.testing.assert_allclose(logits_of(cfg, params, tokens[:, perm]), out[:, perm],
                               rtol=1e-5, atol=1e-5)
    causal = logits_of(cfg.replace(arch="decoder"), params, tokens[:, perm])
    assert not np.allclose(causal, out[:, perm], atol=1e-3)  # a decoder is not


def test_generation_is_refused_in_one_line():
    """A KV cache, generate and beam search refuse an encoder in one line."""
    from jaxformer.attention.kv_cache import init_cache
    from jaxformer.decode import beam_search, generate
    cfg = encoder()
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = init(cfg, tokens)
    for call in (lambda: init_cache(cfg, 1, 8),
                 lambda: generate(Transformer(cfg), params, tokens, max_new_tokens=2,
                                  rng=jax.random.key(0)),
                 lambda: beam_search(Transformer(cfg), params, tokens, beam_width=2,
                                     max_new_tokens=2)):
        with pytest.raises(ConfigError, match="model.arch=encoder has no generation") as e:
            call()
        assert "\n" not in str(e.value)


def test_inspected_patterns_have_no_causal_rule():
    """run_with_cache computes the attention pattern through the hooked reference path: an
    encoder's rows spread over the keys after the query too (within its segment, none
    elsewhere), and its logits are the plain forward's."""
    from jaxformer.model.inspect import run_with_cache
    cfg = encoder()
    tokens, pos, seg = packed_batch()
    params = init(cfg, tokens)
    logits, cache = run_with_cache(Transformer(cfg), params, tokens, positions=pos,
                                   segment_ids=seg, names=["blocks.0.attn.hook_pattern"])
    pattern = np.asarray(cache["blocks.0.attn.hook_pattern"])  # [B, N, T, S]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    assert (pattern[np.broadcast_to(same[:, None], pattern.shape)] > 0).all()
    assert (pattern[np.broadcast_to(~same[:, None], pattern.shape)] == 0).all()
    np.testing.assert_allclose(np.asarray(logits)[seg > 0], logits_of(
        cfg, params, tokens, positions=pos, segment_ids=seg)[seg > 0], rtol=1e-5, atol=1e-5)
