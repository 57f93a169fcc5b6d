"""The length-generalisation schemes (xPos, p-RoPE, KERPLE, Sandwich, CoPE) against float64
formulas written from their papers, at positions far beyond what the model tests reach,
and CoPE's refusal by the backends that never hold a whole row of keys."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.attention.backends import resolve_impl
from jaxformer.model.config import ConfigError
from jaxformer.positions.cope import cope_logits
from jaxformer.positions.formulas import (XPOS_MAX_POSITION, kerple_bias, rope_tables, rotate,
                                          sandwich_bias, sandwich_slopes, xpos_scale)
from jaxformer.positions.schemes import _kerple_bias


def test_xpos_scores_are_rope_times_a_per_frequency_decay_in_the_offset(rng):
    """q_n . k_m = sum_i (RoPE's pair-i product) * zeta_i^((n - m) / 512), in float64, at
    positions up to XPOS_MAX_POSITION (the per-side scales reach 1e+-35 there): the
    scales cancel into the offset."""
    b, t, h = 2, 6, 16
    q, k = rng.standard_normal((2, b, t, 1, h))
    qp = rng.integers(0, XPOS_MAX_POSITION, (b, t))
    kp = np.maximum(qp - rng.integers(0, 600, (b, t)), 0)  # keys at or before the queries

    def side(x, pos, keys):
        cos, sin = rope_tables(jnp.asarray(pos, jnp.int32), h,
                               scale=xpos_scale(jnp.asarray(pos, jnp.int32), h, keys))
        return np.asarray(rotate(jnp.asarray(x, jnp.float32), cos, sin), np.float64)

    got = np.einsum("btnh,btnh->bt", side(q, qp, False), side(k, kp, True))
    inv = 1.0 / 10000.0 ** (np.arange(0, h, 2) / h)
    zeta = (np.arange(0, h, 2) / h + 0.4) / 1.4
    ang = (qp - kp)[..., None] * inv  # the pair products of RoPE depend on n - m
    q1, q2, k1, k2 = q[..., 0, :h // 2], q[..., 0, h // 2:], k[..., 0, :h // 2], k[..., 0, h // 2:]
    pair = (q1 * k1 + q2 * k2) * np.cos(ang) + (q1 * k2 - q2 * k1) * np.sin(ang)
    want = (pair * zeta ** ((qp - kp)[..., None] / 512.0)).sum(-1)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert np.isfinite(np.asarray(xpos_scale(jnp.asarray([[XPOS_MAX_POSITION]]), h, True))).all()


def test_p_rope_keeps_the_highest_frequencies_of_the_full_spectrum(rng):
    """p-RoPE: pairs i < int(p * H // 2) rotate at RoPE's own 1/theta^(2i/H) (not the
    respread frequencies of rope_fraction), the rest not at all."""
    h, p = 16, float(rng.choice([0.25, 0.5, 0.75]))
    pos = jnp.asarray(rng.integers(1, 5000, (1, 7)), jnp.int32)
    cos, sin = (np.asarray(a[0, :, 0], np.float64) for a in rope_tables(pos, h, p=p))
    kept = int(p * h // 2)
    ang = np.asarray(pos[0], np.float64)[:, None] / 10000.0 ** (np.arange(0, h, 2) / h)
    np.testing.assert_allclose(cos[:, :kept], np.cos(ang[:, :kept]), atol=3e-4)
    np.testing.assert_allclose(sin[:, h // 2:h // 2 + kept], np.sin(ang[:, :kept]), atol=3e-4)
    np.testing.assert_array_equal(cos[:, kept:h // 2], 1.0)
    np.testing.assert_array_equal(sin[:, h // 2 + kept:], 0.0)


def test_kerple_bias_is_minus_r1_log_one_plus_r2_distance(rng):
    """The log kernel per head, r1 and r2 clamped at 0.01, in float64, at distances to 1e5;
    a clamped param still gets the gradient of its clamped value (a step can free it)."""
    heads = 3
    r1, r2 = rng.uniform(0.02, 2, heads), rng.uniform(0.02, 1, heads)
    r2[0] = -0.5  # clamped to 0.01
    qp, kp = rng.integers(0, 100_000, (2, 5)), rng.integers(0, 100_000, (2, 7))
    got = kerple_bias(jnp.asarray(r1), jnp.asarray(r2), jnp.asarray(qp), jnp.asarray(kp))
    d = np.abs(qp[:, :, None] - kp[:, None, :])[:, None]
    want = -r1[:, None, None] * np.log1p(np.maximum(r2, 0.01)[:, None, None] * d)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6)
    g = jax.grad(lambda p: _kerple_bias(p, jnp.asarray(qp), jnp.asarray(kp)).sum())(
        {"r1": jnp.asarray(r1, jnp.float32), "r2": jnp.asarray(r2, jnp.float32)})
    want_g = (-r1[:, None, None] * d / (1 + 0.01 * d))[:, 0].sum((0, 1, 2))
    np.testing.assert_allclose(float(g["r2"][0]), want_g, rtol=1e-4)


def test_sandwich_bias_is_the_shifted_sinusoidal_inner_product(rng):
    """sum_{k=1}^{d/2} cos(r / 10000^(2k/d)) - d/2, over head h's 8h/N: 0 at r = 0,
    below 0 beyond; the sinusoidal embeddings' own inner product, formed in float64."""
    heads, dims = 4, 16
    qp, kp = rng.integers(0, 20_000, (2, 5)), rng.integers(0, 20_000, (2, 6))
    kp[:, 0] = qp[:, 0]
    got = np.asarray(sandwich_bias(jnp.asarray(sandwich_slopes(heads), jnp.float32),
                                   jnp.asarray(qp), jnp.asarray(kp), dims=dims))

    def embedding(pos):  # sinusoidal over frequencies k = 1..d/2, as the paper's sum runs
        ang = pos[..., None] / 10000.0 ** (2 * np.arange(1, dims // 2 + 1) / dims)
        return np.concatenate([np.sin(ang), np.cos(ang)], -1)

    inner = np.einsum("bqd,bkd->bqk", embedding(qp.astype(float)), embedding(kp.astype(float)))
    want = (inner - dims / 2)[:, None] / (8 * np.arange(1, heads + 1) / heads)[:, None, None]
    np.testing.assert_allclose(got, want, atol=5e-5 * dims)
    np.testing.assert_allclose(got[:, :, 0, 0], 0.0, atol=1e-6)
    assert (got < 1e-6).all()


def np_cope(q, k, emb, mask):
    """CoPE in float64 one query and key at a time: [B, N, T, S] (GQA by repeating k)."""
    b, t, n, h = q.shape
    s, g = k.shape[1], n // k.shape[2]
    out = np.full((b, n, t, s), -np.inf)
    for bi in range(b):
        for ni in range(n):
            for i in range(t):
                keys = [j for j in range(s) if mask[bi, 0, i, j]]
                dot = {j: q[bi, i, ni] @ k[bi, j, ni // g] for j in keys}
                gate = {j: 1 / (1 + math.exp(-dot[j] / math.sqrt(h))) for j in keys}
                for j in keys:
                    p = min(sum(gate[m] for m in keys if m >= j), emb.shape[1] - 1)
                    lo = math.floor(p)
                    e = emb[:, lo] + (p - lo) * (emb[:, math.ceil(p)] - emb[:, lo])
                    out[bi, ni, i, j] = (dot[j] + q[bi, i, ni] @ e) / math.sqrt(h)
    return out


def gate_counts(q, k, mask):
    """The float64 p_ij before the clamp (sum of the gates of keys j..i) at the allowed
    pairs: a flat array."""
    h, g = q.shape[-1], q.shape[2] // k.shape[2]
    dot = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2))
    gates = np.where(mask, 1 / (1 + np.exp(-dot / math.sqrt(h))), 0.0)
    return np.cumsum(gates[..., ::-1], axis=-1)[..., ::-1][np.broadcast_to(mask, gates.shape)]


def test_cope_logits_match_float64_one_pair_at_a_time(rng):
    """Gates over the allowed keys of a packed, padded row, GQA, against the loop of the
    definition, with P (the table's size) drawn so that the rows use every entry: some
    p_ij falls in each [e, e + 1) below P - 1 (interpolated) and some above P - 1
    (clamped to e[P - 1])."""
    b, t, n, kv, h = 2, 9, 4, 2, 8
    q, k = rng.standard_normal((b, t, n, h)), rng.standard_normal((b, t, kv, h))
    seg = np.array([[1] * 5 + [2] * 4, [1] * 7 + [0] * 2])
    mask = (np.tril(np.ones((t, t), bool)) & (seg[:, :, None] == seg[:, None, :])
            & (seg[:, None, :] != 0))[:, None]
    counts = gate_counts(q, k, mask)
    reach = next(e for e in range(t + 1) if not (np.floor(counts) == e).any())  # 0..reach-1 seen
    npos = int(rng.integers(2, reach + 1))  # P - 1 < reach: some count above it
    assert (counts > npos - 1).any() and (counts < npos - 1).any(), (npos, counts.max())
    emb = rng.standard_normal((h, npos))
    got = cope_logits(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                      jnp.asarray(emb, jnp.float32), jnp.asarray(mask))
    got = np.asarray(got).reshape(b, n, t, t)
    want = np_cope(q, k, emb, mask)
    assert (np.isinf(got) == np.isinf(want)).all()
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("impl", ["blockwise", "chunked", "splash", "xla", "ring"])
def test_backends_without_whole_rows_refuse_cope_in_one_line(impl):
    with pytest.raises(ConfigError, match=f"attention_impl='{impl}' cannot run "
                       r"position='cope'.*use attention_impl='reference' or 'auto'"):
        ModelConfig(position="cope", attention_impl=impl)
    with pytest.raises(ValueError, match="whole row of keys"):
        resolve_impl(impl, jnp.float32, 16, position="cope")
    assert resolve_impl("auto", jnp.float32, 16, position="cope") == "reference"


def test_xpos_past_its_float32_range_is_refused():
    with pytest.raises(ConfigError, match="max_seq_len=40000 is past 32768.*xPos"):
        ModelConfig(position="xpos", max_seq_len=40000)
    with pytest.raises(ConfigError, match="p_rope=0.5 needs a rotary position scheme"):
        ModelConfig(position="alibi", p_rope=0.5)
