"""Tests for jaxformer.positions.formulas (with the RoPE scalings of
jaxformer.positions.rope_scaling) against float64 NumPy references and textbook numbers.

Every random input comes from a fresh seed; the ``rng`` fixture (tests/conftest.py) prints
it, so a failing run shows the JAXFORMER_TEST_SEED that reproduces it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model.config import ConfigError, RopeScaling
from jaxformer.positions.formulas import (FIRE_EPS, alibi_bias, alibi_slopes, apply_rope,
                                          fire_distance, relative_position_bucket, rope_frequencies,
                                          segment_positions, sinusoidal, t5_bias)

EPS32 = float(np.finfo(np.float32).eps)


def angle_atol(max_position, magnitude=1.0):
    """Error budget of a float32 angle pos * inv_freq (two ulps of the largest angle)."""
    return (2 * EPS32 * max_position + 1e-5) * magnitude


# ---- float64 references (written from the papers / HF modeling_rope_utils) ----------

def ref_sinusoidal(positions, d_model):
    pe = np.zeros(positions.shape + (d_model,), np.float64)
    pos = positions.astype(np.float64)
    for i in range(d_model // 2):
        angle = pos / 10000.0 ** (2 * i / d_model)
        pe[..., 2 * i] = np.sin(angle)
        pe[..., 2 * i + 1] = np.cos(angle)
    return pe


def ref_base_inv_freq(dim, base):
    return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def ref_inv_freq(dim, theta, scaling):
    """(inv_freq, attention_factor) following transformers' _compute_*_parameters."""
    kind, factor = scaling.kind, scaling.factor
    if kind == "none":
        return ref_base_inv_freq(dim, theta), 1.0
    if kind == "linear":
        return ref_base_inv_freq(dim, theta) / factor, 1.0
    if kind == "ntk":
        base = theta * factor ** (dim / (dim - 2))
        return ref_base_inv_freq(dim, base), 1.0
    if kind == "llama3":
        inv_freq = ref_base_inv_freq(dim, theta)
        orig = scaling.original_max_seq_len
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        low_freq_wavelen = orig / low
        high_freq_wavelen = orig / high
        out = np.empty_like(inv_freq)
        for i, f in enumerate(inv_freq):
            wavelen = 2 * math.pi / f
            if wavelen < high_freq_wavelen:
                out[i] = f
            elif wavelen > low_freq_wavelen:
                out[i] = f / factor
            else:
                smooth = (orig / wavelen - low) / (high - low)
                out[i] = (1 - smooth) * f / factor + smooth * f
        return out, 1.0
    if kind == "yarn":
        inv_freq = ref_base_inv_freq(dim, theta)
        orig = scaling.original_max_seq_len

        def find_correction_dim(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = find_correction_dim(scaling.beta_fast), find_correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        out = (inv_freq / factor) * (1 - extrapolation_factor) + inv_freq * extrapolation_factor
        attention_factor = scaling.attention_factor
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return out, attention_factor
    raise AssertionError(kind)


def ref_apply_rope(x, positions, theta, scaling):
    """HF Llama rotary embedding in float64; x [B, T, N, D], positions [B, T]."""
    x = x.astype(np.float64)
    inv_freq, attention_factor = ref_inv_freq(x.shape[-1], theta, scaling)
    freqs = positions.astype(np.float64)[..., None] * inv_freq  # [B, T, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    cos = (np.cos(emb) * attention_factor)[:, :, None, :]  # [B, T, 1, D]
    sin = (np.sin(emb) * attention_factor)[:, :, None, :]
    half = x.shape[-1] // 2
    rotate_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotate_half * sin


def random_scaling(kind, rng):
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rng.uniform(1.0, 16.0)))
    if kind == "ntk":
        return RopeScaling(kind="ntk", factor=float(rng.uniform(1.0, 8.0)))
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=float(rng.uniform(2.0, 16.0)),
                           original_max_seq_len=int(rng.integers(256, 8193)),
                           low_freq_factor=float(rng.uniform(1.0, 2.0)),
                           high_freq_factor=float(rng.uniform(3.0, 8.0)))
    if kind == "yarn":
        explicit = rng.random() < 0.5
        return RopeScaling(kind="yarn", factor=float(rng.uniform(2.0, 32.0)),
                           original_max_seq_len=int(rng.integers(512, 8193)),
                           beta_fast=float(rng.uniform(16.0, 64.0)),
                           beta_slow=float(rng.uniform(0.5, 2.0)),
                           attention_factor=float(rng.uniform(0.5, 2.0)) if explicit else None,
                           truncate=bool(rng.random() < 0.5))
    raise AssertionError(kind)


KINDS = ["none", "linear", "ntk", "llama3", "yarn"]


# ---- sinusoidal ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(17,), (3, 11), (2, 3, 5)])
def test_sinusoidal_matches_textbook_formula(rng, shape):
    d_model = int(rng.choice([4, 8, 64, 130]))
    positions = rng.integers(0, 2048, size=shape)
    got = np.asarray(sinusoidal(jnp.asarray(positions, jnp.int32), d_model))
    assert got.shape == shape + (d_model,)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref_sinusoidal(positions, d_model),
                               rtol=0, atol=angle_atol(positions.max()))


def test_sinusoidal_position_zero_is_sin0_cos0():
    got = np.asarray(sinusoidal(jnp.zeros((1,), jnp.int32), 6))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 0, 1]])


def test_sinusoidal_odd_d_model_raises():
    with pytest.raises(ValueError, match="sinusoidal positions need an even d_model, got 7"):
        sinusoidal(jnp.arange(4), 7)


# ---- rope_frequencies ----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_rope_frequencies_match_reference(rng, kind):
    head_dim = int(rng.choice([16, 32, 64, 128]))
    theta = float(rng.choice([10000.0, 500000.0, rng.uniform(1e3, 1e6)]))
    scaling = random_scaling(kind, rng)
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    want_inv_freq, want_attention = ref_inv_freq(head_dim, theta, scaling)
    assert isinstance(inv_freq, np.ndarray)
    assert inv_freq.dtype == np.float64
    assert inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, want_inv_freq, rtol=1e-12, atol=0)
    assert attention_factor == pytest.approx(want_attention, rel=1e-12)


def test_rope_frequencies_default_is_unscaled(rng):
    head_dim = 2 * int(rng.integers(1, 129))
    theta = float(rng.uniform(100.0, 1e6))
    inv_freq, attention_factor = rope_frequencies(head_dim, theta)
    np.testing.assert_allclose(inv_freq, theta ** (-np.arange(head_dim // 2) * 2.0 / head_dim),
                               rtol=1e-12)
    assert inv_freq[0] == 1.0
    assert attention_factor == 1.0


@pytest.mark.parametrize("kind", ["linear", "ntk"])
def test_factor_one_gives_unscaled_frequencies(rng, kind):
    head_dim = int(rng.choice([8, 64, 128]))
    theta = float(rng.uniform(1e3, 1e6))
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, RopeScaling(kind=kind, factor=1.0))
    np.testing.assert_allclose(inv_freq, ref_base_inv_freq(head_dim, theta), rtol=1e-12)
    assert attention_factor == 1.0


def test_llama31_8b_frequencies():
    scaling = RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=8192,
                          low_freq_factor=1.0, high_freq_factor=4.0)
    inv_freq, attention_factor = rope_frequencies(128, 500000.0, scaling)
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    assert inv_freq[0] == 1.0  # highest frequency kept
    assert inv_freq[-1] == base[-1] / 8  # lowest frequency divided by exactly 8
    assert attention_factor == 1.0
    wavelen = 2 * np.pi / base
    high_band = wavelen < 8192 / 4.0
    low_band = wavelen > 8192 / 1.0
    medium = ~high_band & ~low_band
    np.testing.assert_array_equal(inv_freq[high_band], base[high_band])
    np.testing.assert_array_equal(inv_freq[low_band], base[low_band] / 8)
    assert medium.any()  # the smooth band is hit and lies strictly between the two rules
    assert np.all(inv_freq[medium] < base[medium])
    assert np.all(inv_freq[medium] > base[medium] / 8)
    assert np.all(np.diff(inv_freq) < 0)  # still monotone after the band rule


def test_yarn_default_attention_factor():
    scaling = RopeScaling(kind="yarn", factor=16.0, original_max_seq_len=4096)
    _, attention_factor = rope_frequencies(64, 10000.0, scaling)
    assert attention_factor == pytest.approx(0.1 * math.log(16.0) + 1.0, rel=1e-12)
    scaling = RopeScaling(kind="yarn", factor=16.0, original_max_seq_len=4096, attention_factor=1.25)
    assert rope_frequencies(64, 10000.0, scaling)[1] == 1.25


def test_yarn_keeps_fast_and_interpolates_slow_dims():
    scaling = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=2048)
    inv_freq, _ = rope_frequencies(128, 10000.0, scaling)
    base = ref_base_inv_freq(128, 10000.0)
    # find_correction_dim(32) = 128 ln(2048 / (64 pi)) / (2 ln 10000) = 16.08 -> low 16
    # find_correction_dim(1) = 128 ln(2048 / (2 pi)) / (2 ln 10000) = 40.2 -> high 41
    np.testing.assert_array_equal(inv_freq[:17], base[:17])
    np.testing.assert_allclose(inv_freq[41:], base[41:] / 4, rtol=1e-15)
    assert np.all((inv_freq[17:41] < base[17:41]) & (inv_freq[17:41] > base[17:41] / 4))


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_missing_original_max_seq_len_raises(kind):
    with pytest.raises(ValueError, match="original_max_seq_len"):
        rope_frequencies(64, 10000.0, RopeScaling(kind=kind, factor=4.0))


def test_odd_head_dim_raises():
    with pytest.raises(ValueError, match="RoPE needs an even head_dim, got 63"):
        rope_frequencies(63, 10000.0)
    with pytest.raises(ValueError, match="RoPE needs an even head_dim, got 5"):
        apply_rope(jnp.ones((1, 2, 1, 5)), jnp.zeros((1, 2), jnp.int32))


def test_ntk_needs_head_dim_at_least_4():
    with pytest.raises(ValueError, match="head_dim >= 4"):
        rope_frequencies(2, 10000.0, RopeScaling(kind="ntk", factor=2.0))


def test_bogus_scaling_kind_names_allowed_kinds():
    with pytest.raises(ConfigError) as err:
        RopeScaling(kind="bogus")
    message = str(err.value)
    assert "bogus" in message
    for kind in KINDS:
        assert kind in message


# ---- apply_rope ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_apply_rope_matches_hf_llama_reference(rng, kind):
    batch, seq, heads = 2, int(rng.integers(3, 12)), int(rng.integers(1, 5))
    head_dim = int(rng.choice([8, 32, 64, 128]))
    theta = float(rng.choice([10000.0, 500000.0]))
    scaling = random_scaling(kind, rng)
    x = rng.normal(size=(batch, seq, heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 4096, size=(batch, seq))  # each row its own positions
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), theta=theta, scaling=scaling)
    assert got.shape == x.shape
    assert got.dtype == jnp.float32
    want = ref_apply_rope(x, positions, theta, scaling)
    magnitude = np.abs(x).max() * ref_inv_freq(head_dim, theta, scaling)[1]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                               atol=angle_atol(positions.max(), magnitude))


def test_apply_rope_position_zero_is_identity(rng):
    x = rng.normal(size=(2, 3, 4, 16)).astype(np.float32)
    got = apply_rope(jnp.asarray(x), jnp.zeros((2, 3), jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), x)


def test_apply_rope_half_rotation_pairs_dim_i_with_i_plus_half():
    # A unit vector on dim 0 at position 1 rotates into dim head_dim/2 (not dim 1).
    head_dim = 8
    x = np.zeros((1, 1, 1, head_dim), np.float32)
    x[..., 0] = 1.0
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.ones((1, 1), jnp.int32)))[0, 0, 0]
    want = np.zeros(head_dim)
    want[0], want[head_dim // 2] = math.cos(1.0), math.sin(1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_rope_scores_depend_only_on_offset(rng, kind):
    n, head_dim = 64, int(rng.choice([16, 64, 128]))
    theta = float(rng.choice([10000.0, 500000.0]))
    scaling = random_scaling(kind, rng)
    q = rng.normal(size=(n, 1, 1, head_dim)).astype(np.float32)
    k = rng.normal(size=(n, 1, 1, head_dim)).astype(np.float32)
    i = rng.integers(0, 2048, size=(n, 1))
    j = rng.integers(0, 2048, size=(n, 1))
    s = rng.integers(1, 2048, size=(n, 1))

    def scores(pos_q, pos_k):
        rq = apply_rope(jnp.asarray(q), jnp.asarray(pos_q, jnp.int32), theta=theta, scaling=scaling)
        rk = apply_rope(jnp.asarray(k), jnp.asarray(pos_k, jnp.int32), theta=theta, scaling=scaling)
        return np.sum(np.asarray(rq, np.float64) * np.asarray(rk, np.float64), axis=-1)[:, 0, 0]

    attention_factor = ref_inv_freq(head_dim, theta, scaling)[1]
    scale = (np.linalg.norm(q, axis=-1) * np.linalg.norm(k, axis=-1))[:, 0, 0] * attention_factor**2
    np.testing.assert_array_less(np.abs(scores(i, j) - scores(i + s, j + s)),
                                 angle_atol(4096, scale))
    # ... and the score really changes with the offset (not trivially constant):
    assert np.abs(scores(i, j) - scores(i, j + s)).max() > 1e-2 * scale.max()


@pytest.mark.parametrize("kind", KINDS)
def test_apply_rope_preserves_norms(rng, kind):
    head_dim = int(rng.choice([8, 64, 128]))
    scaling = random_scaling(kind, rng)
    x = rng.normal(size=(2, 9, 3, head_dim)).astype(np.float32)
    positions = rng.integers(0, 8192, size=(2, 9))
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), scaling=scaling),
                     np.float64)
    attention_factor = ref_inv_freq(head_dim, 10000.0, scaling)[1]
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1),
                               attention_factor * np.linalg.norm(x.astype(np.float64), axis=-1),
                               rtol=1e-5)


def test_linear_scaling_is_position_interpolation(rng):
    factor = int(rng.integers(2, 9))
    head_dim = int(rng.choice([16, 64]))
    x = rng.normal(size=(2, 7, 2, head_dim)).astype(np.float32)
    positions = rng.integers(0, 1024, size=(2, 7))
    scaled = apply_rope(jnp.asarray(x), jnp.asarray(factor * positions, jnp.int32),
                        scaling=RopeScaling(kind="linear", factor=float(factor)))
    unscaled = apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32))
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(unscaled), rtol=0,
                               atol=2 * angle_atol(factor * positions.max(), np.abs(x).max()))


def test_apply_rope_keeps_dtype(rng):
    x = jnp.asarray(rng.normal(size=(1, 4, 2, 16)), jnp.bfloat16)
    assert apply_rope(x, jnp.arange(4)[None]).dtype == jnp.bfloat16


# ---- ALiBi ---------------------------------------------------------------------------

@pytest.mark.parametrize("n, exponents", [
    (1, [-8]),
    (6, [-2, -4, -6, -8, -1, -3]),
    (8, [-1, -2, -3, -4, -5, -6, -7, -8]),
    (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
    (16, [-0.5, -1, -1.5, -2, -2.5, -3, -3.5, -4, -4.5, -5, -5.5, -6, -6.5, -7, -7.5, -8]),
])
def test_alibi_slopes_textbook_values(n, exponents):
    slopes = alibi_slopes(n)
    assert slopes.shape == (n,)
    np.testing.assert_allclose(slopes, 2.0 ** np.asarray(exponents, np.float64), rtol=1e-14)


def test_alibi_slopes_rejects_zero_heads():
    with pytest.raises(ValueError, match="alibi_slopes needs n_heads >= 1, got 0"):
        alibi_slopes(0)


def test_alibi_bias_matches_numpy(rng):
    batch, heads, tq, tk = 2, int(rng.integers(1, 9)), int(rng.integers(1, 10)), int(rng.integers(1, 14))
    slopes = rng.uniform(0.01, 1.0, size=heads)
    q_pos = rng.integers(0, 500, size=(batch, tq))
    k_pos = rng.integers(0, 500, size=(batch, tk))
    got = alibi_bias(slopes, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32))
    assert got.shape == (batch, heads, tq, tk)
    assert got.dtype == jnp.float32
    want = np.empty((batch, heads, tq, tk))
    for b in range(batch):
        for h in range(heads):
            for a in range(tq):
                for c in range(tk):
                    want[b, h, a, c] = -slopes[h] * abs(int(q_pos[b, a]) - int(k_pos[b, c]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-7, atol=0)


# ---- T5 buckets and FIRE ----------------------------------------------------------------

BUCKETINGS = [(False, 32, 128), (True, 32, 128), (False, 8, 20), (True, 12, 40), (False, 64, 512)]


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", BUCKETINGS)
def test_relative_position_bucket_matches_hf_t5(rng, bidirectional, num_buckets, max_distance):
    """Every relative position out to 3x max_distance, and random far ones, fall in the
    bucket Hugging Face's T5 gives them."""
    torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5", reason="the interop extra")
    near = np.arange(-3 * max_distance, 3 * max_distance + 1)
    far = rng.integers(-(1 << 30), 1 << 30, size=1000)
    rel = np.concatenate([near, far, rng.permutation(near)]).astype(np.int32)
    want = t5.T5Attention._relative_position_bucket(
        torch.from_numpy(rel), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance).numpy()
    got = relative_position_bucket(jnp.asarray(rel), bidirectional=bidirectional,
                                   num_buckets=num_buckets, max_distance=max_distance)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_relative_position_bucket_textbook_values():
    """T5's decoder defaults: distances 0-15 exact, 16-127 log-spaced, 128 on the last."""
    rel = -jnp.asarray([0, 1, 15, 16, 22, 45, 90, 127, 128, 10**6, 3, -0], jnp.int32)
    got = relative_position_bucket(rel)
    # 16 + floor(log(d / 16) / log(8) * 16): 22 -> 18, 45 -> 23, 90 -> 29, 127 -> 31
    np.testing.assert_array_equal(np.asarray(got), [0, 1, 15, 16, 18, 23, 29, 31, 31, 31, 3, 0])
    future = relative_position_bucket(jnp.asarray([1, 5, 1000]))  # keys after the query
    np.testing.assert_array_equal(np.asarray(future), [0, 0, 0])


def test_t5_bias_gathers_per_head_and_bucket(rng):
    buckets, heads, tq, tk = 8, int(rng.integers(1, 5)), int(rng.integers(1, 9)), 11
    table = rng.standard_normal((buckets, heads)).astype(np.float32)
    q_pos = rng.integers(0, 60, size=(2, tq))
    k_pos = rng.integers(0, 60, size=(2, tk))
    got = np.asarray(t5_bias(jnp.asarray(table), jnp.asarray(q_pos), jnp.asarray(k_pos),
                             max_distance=20))
    assert got.shape == (2, heads, tq, tk)

    def bucket(d):  # float64 textbook: exact below 4, log-spaced to 20, then the last
        return d if d < 4 else min(4 + int(math.log(d / 4) / math.log(5) * 4), 7)

    for b, i, j in np.ndindex(2, tq, tk):
        d = max(int(q_pos[b, i]) - int(k_pos[b, j]), 0)
        np.testing.assert_array_equal(got[b, :, i, j], table[bucket(d)])


def test_fire_distance_matches_formula(rng):
    """psi(i - j) / psi(max(L, i)) with psi(x) = log(|c x| + 1), in float64."""
    c, threshold = float(rng.uniform(0.01, 2)), float(rng.uniform(1, 40))
    q_pos = rng.integers(0, 100, size=(2, 7))
    k_pos = rng.integers(0, 100, size=(2, 9))
    got = np.asarray(fire_distance(jnp.asarray(q_pos), jnp.asarray(k_pos), c, threshold))
    psi = lambda x: np.log(np.abs(c * x) + 1)  # noqa: E731
    i, j = q_pos[:, :, None].astype(np.float64), k_pos[:, None, :].astype(np.float64)
    want = psi(i - j) / (psi(np.maximum(threshold, i)) + FIRE_EPS)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_fire_distance_to_the_first_token_is_one_beyond_the_threshold(rng):
    """Progressive interpolation: past L the distance to position 0 is normalised to 1, so
    every longer context maps into [0, 1]; before L it is below 1."""
    threshold = float(rng.integers(5, 50))
    q = jnp.arange(200)[None]
    got = np.asarray(fire_distance(q, jnp.zeros((1, 1), jnp.int32), 0.1, threshold))[0, :, 0]
    beyond = np.arange(200) >= threshold
    np.testing.assert_allclose(got[beyond], 1.0, rtol=1e-5)
    assert (got[~beyond] < 1.0).all() and np.isfinite(got).all()


# ---- segment_positions ---------------------------------------------------------------

def ref_segment_positions(segment_ids):
    out = np.zeros_like(segment_ids)
    for b, row in enumerate(segment_ids):
        for t in range(len(row)):
            out[b, t] = 0 if t == 0 or row[t] != row[t - 1] else out[b, t - 1] + 1
    return out


def test_segment_positions_example():
    got = segment_positions(jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 2, 0, 1, 0, 0, 1]])


def test_segment_positions_random_packed_rows(rng):
    batch, seq = 4, int(rng.integers(1, 40))
    rows = []
    for _ in range(batch):
        row = []
        segment = 1
        while len(row) < seq:
            row += [segment] * int(rng.integers(1, 8))
            segment += 1
        row = row[:seq]
        pad = int(rng.integers(0, seq + 1))
        rows.append(row[: seq - pad] + [0] * pad)
    ids = np.asarray(rows, np.int32)
    got = segment_positions(jnp.asarray(ids))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), ref_segment_positions(ids))


def test_segment_positions_arbitrary_ids_under_jit(rng):
    ids = rng.integers(0, 3, size=(3, 25)).astype(np.int32)  # runs of repeated small ids
    got = jax.jit(segment_positions)(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), ref_segment_positions(ids))
