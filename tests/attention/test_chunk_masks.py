"""Chunked local attention (jaxformer.attention.masks.chunk_mask, MaskRule.chunk, a layer
kind's chunk: Llama 4's): the mask against its NumPy definition with packed segments, the
chunk traced as a scanned layer's; attention under it equal to causal attention run on each
chunk alone (float64 NumPy); a model of chunked and global layers decoding from a KV cache
(a ring, and full-length slots) as its full forward, and packed documents as apart."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.attention.backends import rule_attention
from jaxformer.attention.kv_cache import init_cache
from jaxformer.attention.masks import MaskRule, pick_rule
from jaxformer.core.validation import ConfigError
from tests.attention.reference import np_causal, np_segment

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def packed_rows(b: int, t: int):
    """positions and segment ids [b, t] of two documents per row (positions restarting,
    the second document's length drawn), and padding (segment 0) at some rows' ends."""
    pos, seg = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for r in range(b):
        cut, end = int(rng.integers(2, t - 2)), int(rng.integers(t - 2, t + 1))
        pos[r, :cut], seg[r, :cut] = np.arange(cut), 1
        pos[r, cut:end], seg[r, cut:end] = np.arange(end - cut), 2
    return pos, seg


def test_chunk_mask_matches_its_definition_packed_and_traced():
    pos, seg = packed_rows(3, 13)
    chunk = int(rng.integers(2, 5))
    want = np_causal(pos, pos) & np_segment(seg, seg) & \
        ((pos[:, None, :, None] // chunk) == (pos[:, None, None, :] // chunk))
    rules = (MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg)),
             MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg),
                      window=chunk, chunk=chunk))
    np.testing.assert_array_equal(np.asarray(rules[1].dense()), want)
    traced = jax.jit(lambda kind: pick_rule(rules, kind).dense())  # a scanned layer's kind
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(1))), want)
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(0))),
                                  np_causal(pos, pos) & np_segment(seg, seg))


def np_attention(q, k, v):
    """Causal float64 attention of q [B, T, N, H] over k, v [B, T, K, H]."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla"])
def test_chunked_attention_is_attention_within_each_chunk(impl):
    b, t, chunk = 2, 11, int(rng.integers(2, 5))
    q = rng.normal(size=(b, t, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(b, t, 2, 8)).astype(np.float32) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rule = MaskRule(pos, pos, window=chunk, chunk=chunk, is_causal=True)
    got = np.asarray(rule_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), rule,
                                    impl=impl))
    for s in range(0, t, chunk):
        part = slice(s, s + chunk)
        np.testing.assert_allclose(got[:, part], np_attention(q[:, part], k[:, part],
                                                              v[:, part]), rtol=1e-5, atol=1e-5)


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=32, layer_pattern=("chunked", "global"),
                  layer_kinds={"chunked": dict(chunk=3), "global": {}},
                  attention_impl="reference")


@functools.lru_cache(maxsize=None)
def decoded(windowed: bool):
    """jit(params, tokens [2, T] -> logits of a 5-token prefill then one-token steps)."""
    model = Transformer(CFG)

    @jax.jit
    def run(params, tokens):
        b, t = tokens.shape
        apply = functools.partial(model.apply, {"params": params})
        logits, cache = apply(tokens[:, :5], cache=init_cache(CFG, b, t, windowed=windowed))

        def step(cache, tok):
            out, cache = apply(tok[:, None], cache=cache)
            return cache, out[:, 0]
        rest = jax.lax.scan(step, cache, tokens[:, 5:].T)[1].transpose(1, 0, 2)
        return jnp.concatenate([logits, rest], 1)
    return run


def test_chunked_layers_decode_and_pack_as_their_full_forward():
    model = Transformer(CFG)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 11)))
    params = model.init(jax.random.key(int(rng.integers(1 << 31))), tokens)["params"]
    full = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    for windowed in (True, False):  # a ring of the chunk's slots, and every slot
        np.testing.assert_allclose(np.asarray(decoded(windowed)(params, tokens)), full,
                                   rtol=1e-5, atol=1e-5, err_msg=f"windowed={windowed}")
    cut = 7  # the second document starts mid-chunk
    pos = np.concatenate([np.arange(cut), np.arange(11 - cut)])[None].repeat(2, 0)
    seg = np.repeat([1, 2], [cut, 11 - cut])[None].repeat(2, 0)
    packed = np.asarray(jax.jit(model.apply)({"params": params}, tokens, jnp.asarray(pos),
                                             jnp.asarray(seg)))
    apart = np.asarray(jax.jit(model.apply)({"params": params}, tokens[:, cut:]))
    np.testing.assert_allclose(packed[:, :cut], full[:, :cut], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, cut:], apart, rtol=1e-5, atol=1e-5)


def test_a_window_wider_than_the_chunk_is_refused():
    with pytest.raises(ConfigError, match="window=8 is wider than its chunk=4"):
        CFG.replace(layer_kinds={"chunked": dict(chunk=4, window=8), "global": {}})
