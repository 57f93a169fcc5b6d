"""The int8 KV cache format (jaxformer.attention.cache_formats) on its own: quantisation
against float64 NumPy (scales per token and head, rounding, clipping), take_rows moving
values and scales together, the bytes kv_cache_bytes counts, a bad cache_dtype refused.
Cached forwards over it: tests/decode/test_int8_cache.py. Fresh random inputs every run."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.attention import cache_formats
from jaxformer.attention.kv_cache import init_cache, kv_cache_bytes, take_rows
from jaxformer.decode.loops import generate

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)


def np_quantised(x):
    """float64 NumPy: (int values, scale) of each vector of x's last axis."""
    x = np.asarray(x, np.float64)
    scale = np.abs(x).max(-1, keepdims=True) / 127
    q = np.clip(np.round(x / np.where(scale > 0, scale, 1)), -127, 127)
    return q, scale


def test_quantise_round_trip_against_float64_numpy():
    x = rng.standard_normal((3, 5, 2, 8)).astype(np.float32)
    x *= 10.0 ** rng.uniform(-3, 3, (3, 5, 2, 1))  # each head of each token its own range
    x[0, 1, 0] = 0  # a zero vector: scale 0, values 0
    x[1, 2, 1, 3] = 50.0 * np.abs(x[1, 2, 1]).max()  # one outlier: its head's scale only
    got = cache_formats.quantised(jnp.asarray(x))
    q, scale = np_quantised(x)
    assert got.values.dtype == jnp.int8 and got.values.shape == x.shape
    assert got.scale.shape == (3, 5, 2, 1)
    np.testing.assert_allclose(got.scale, scale, rtol=1e-6)
    # float32 x / s may round the other way only at a tie (within float32's error of .5)
    tie = np.abs(np.abs(x / np.where(scale > 0, scale, 1)) % 1 - 0.5) < 1e-4
    off = np.asarray(got.values, np.float64) != q
    assert not (off & ~tie).any()
    back = np.asarray(cache_formats.dequantised(got), np.float64)
    np.testing.assert_allclose(back, q * scale, rtol=1e-6, atol=1e-30)
    assert (np.abs(back - x) <= scale / 2 * (1 + 1e-5) + 1e-30).all()
    # too small a scale saturates at +-127 (never wraps to -128)
    s = scale / rng.uniform(2, 4)
    sat = np.asarray(cache_formats.int8_values(jnp.asarray(x), jnp.asarray(s, jnp.float32)))
    want = np.clip(np.round(x / np.where(s > 0, s, 1)), -127, 127)
    near = np.abs(np.abs(x / np.where(s > 0, s, 1)) % 1 - 0.5) < 1e-4
    assert not ((sat != want) & ~near).any() and np.abs(sat).max() == 127


def config(n_layers=2, **kw):
    """A tiny model's config: GQA, 4 heads over 2 K/V heads, head_dim 8."""
    return ModelConfig(**{**dict(vocab_size=37, d_model=32, n_layers=n_layers, n_heads=4,
                                 n_kv_heads=2, max_seq_len=32, position="rope"), **kw})


def make(seed, n_layers=2, **kw):
    """A tiny model (config) and sharp random params."""
    cfg = config(n_layers, **kw)
    init = Transformer(cfg.replace(scan_layers=False, attention_impl="reference"))
    params = init.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    return Transformer(cfg), jax.tree.map(lambda x: x * 3.0, params)


def test_take_rows_moves_values_and_scales_together():
    cfg = config(n_layers=1)
    b, n_kv, s, h = 3, 2, 5, 8
    x = rng.standard_normal((b * n_kv, s, h)).astype(np.float32) * rng.uniform(
        0.1, 10, (b * n_kv, s, 1)).astype(np.float32)
    cache = init_cache(cfg, b, s, "int8")
    layer = dict(cache["layers"]["block_0"], k=cache_formats.quantised(jnp.asarray(x)))
    rows = rng.integers(0, b, 4)
    got = take_rows(dict(cache, layers={"block_0": layer}), jnp.asarray(rows), n_kv)
    kv_rows = (rows[:, None] * n_kv + np.arange(n_kv)).reshape(-1)
    q, scale = np_quantised(x[kv_rows])
    np.testing.assert_allclose(cache_formats.dequantised(got["layers"]["block_0"]["k"]),
                               q * scale, rtol=1e-6, atol=1e-30)


def test_int8_bytes_are_half_of_bf16_plus_the_scales():
    """kv_cache_bytes(int8) is what init_cache holds: per (K/V row, slot) 2H bytes of
    values and two float32 scales, (2H + 8) / 4H of bf16's; a ring counts its window."""
    cfg, h = config(layer_pattern=("local", "global"),
                    layer_kinds={"local": {"window": 3}, "global": {}}), 8
    for windowed, slots in ((False, 2 * 20), (True, 3 + 20)):
        cache = init_cache(cfg, 3, 20, "int8", windowed=windowed)
        held = sum(x.nbytes for x in jax.tree.leaves(cache["layers"]) if x.ndim == 3)
        int8 = kv_cache_bytes(cfg, 3, 20, "int8", windowed=windowed)
        bf16 = kv_cache_bytes(cfg, 3, 20, jnp.bfloat16, windowed=windowed)
        assert held == int8 == 3 * 2 * slots * (2 * h + 8)
        assert Fraction(int8, bf16) == Fraction(2 * h + 8, 4 * h)
    mla = config(mla=MLA, n_kv_heads=None, norm="rmsnorm", use_bias=False)
    assert kv_cache_bytes(mla, 1, 1, "int8") == 2 * (12 + 4 + 8)  # latent + rope key


def test_bad_cache_dtype_is_refused_in_one_line():
    model = Transformer(config(n_layers=1))  # refused before any weight is read
    with pytest.raises(ValueError) as e:
        generate(model, {}, np.ones((1, 3), np.int32), max_new_tokens=2,
                 rng=jax.random.key(0), cache_dtype="int4")
    assert str(e.value) == ("cache_dtype='int4' is not a KV cache format; choose one of "
                            "float32, bfloat16, float16, int8")
