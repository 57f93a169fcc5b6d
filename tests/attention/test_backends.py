"""Every backend (jaxformer.attention.backends) against the float64 reference; dispatch and
the rules that choose a backend (jaxformer.attention.rules); soft-capping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.attention import attention_weights, backends, dot_product_attention, resolve_impl
from jaxformer.attention.backends import rule_attention
from tests.attention.reference import (BACKENDS, CONFIGS, MASK_KINDS, B, H, alibi_like_bias, as_jnp,
                                       attend, attend_grads, build_case, np_attention,
                                       np_attention_grads, np_causal, np_index_causal, np_padding,
                                       np_segment, np_window, random_positions, random_qkv)

# ---- 2./3. every mask kind, GQA ratio and backend against the float64 reference -------


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("n,kv,tq,tk", CONFIGS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_dot_product_attention_matches_reference(rng, kind, n, kv, tq, tk, impl):
    q, k, v = random_qkv(rng, B, tq, tk, n, kv)
    mask, bias = build_case(rng, kind, B, tq, tk, n)
    jmask, jbias = as_jnp(mask, bias)
    out = attend(q, k, v, mask=jmask, bias=jbias, impl=impl)
    assert out.dtype == jnp.float32 and out.shape == (B, tq, n, H)
    _, expected = np_attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)


# ---- 2b. is_causal: keys after the query's index hidden too, on every mask kind -----


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("n,kv", [(4, 2), (6, 3)])  # MHA and MQA: test_gqa_equals_mha
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_is_causal_matches_reference(rng, kind, n, kv, impl):
    t = 8  # three causal blocks in the chunked backend
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    mask, bias = build_case(rng, kind, B, t, t, n)
    jmask, jbias = as_jnp(mask, bias)
    out = attend(q, k, v, mask=jmask, bias=jbias, impl=impl, is_causal=True)
    _, expected = np_attention(q, k, v, mask=np_index_causal(mask, t), bias=bias)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mask_shape,bias_shape", [("B11T", "1N1T"), ("BNTT", "B1TT"),
                                                    ("11TT", "11TT")])
def test_is_causal_with_broadcast_masks_and_gradients(rng, impl, mask_shape, bias_shape):
    """Masks and biases with size-1 axes (a key-padding mask [B, 1, 1, T], a per-key bias),
    against the float64 reference; the gradients against the reference backend's."""
    n, kv, t = 4, 2, 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    sizes = {"B": B, "N": n, "T": t, "1": 1}
    mask = rng.random(size=[sizes[c] for c in mask_shape]) < 0.7
    bias = rng.normal(size=[sizes[c] for c in bias_shape]).astype(np.float32)
    jmask, jbias = as_jnp(mask, bias)
    out = attend(q, k, v, mask=jmask, bias=jbias, impl=impl, is_causal=True)
    _, expected = np_attention(q, k, v, mask=np_index_causal(mask, t), bias=bias)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)

    cot = jnp.asarray(rng.normal(size=(B, t, n, H)), jnp.float32)
    def grads(impl):
        return attend_grads(q, k, v, cot, mask=jmask, bias=jbias, impl=impl,
                            is_causal=True)[0]
    for got, want in zip(grads(impl), grads("reference")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("bias_shape", ["BNTT", "1N1T", "11TT"])
def test_gradients_of_q_k_v_and_bias_match_float64(rng, impl, is_causal, bias_shape):
    """Every input's gradient, the bias's included (T5 and FIRE learn through it), against
    the float64 softmax Jacobian, with GQA, broadcast biases and some rows fully masked."""
    n, kv, t = 4, 2, 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    sizes = {"B": B, "N": n, "T": t, "1": 1}
    bias = rng.normal(size=[sizes[c] for c in bias_shape]).astype(np.float32)
    mask = rng.random(size=(B, 1, t, t)) < 0.6
    mask[0, 0, 2] = False  # a query with no key at all: zero output and zero gradient
    d_out = rng.normal(size=(B, t, n, H)).astype(np.float32)

    got, _ = attend_grads(q, k, v, d_out, mask=jnp.asarray(mask), bias=jnp.asarray(bias),
                          bias_grad=True, impl=impl, is_causal=is_causal)
    full_mask = np_index_causal(mask, t) if is_causal else mask
    want = np_attention_grads(q, k, v, d_out, full_mask, bias)
    for name, g, w in zip(["q", "k", "v", "bias"], got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=2e-5, err_msg=name)


def test_is_causal_needs_square_attention(rng):
    q, k, v = random_qkv(rng, 1, 3, 8, 4, 2)
    for impl in BACKENDS:
        with pytest.raises(ValueError, match="is_causal needs as many keys as queries"):
            dot_product_attention(q, k, v, impl=impl, is_causal=True)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("bias_shape", ["1N", "B1", "11"])
def test_broadcast_bias_and_per_head_mask(rng, impl, bias_shape):
    """Bias with a size-1 batch or head axis; mask with a full head axis [B, N, Tq, Tk]."""
    n, kv, t = 4, 2, 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    bias = rng.normal(size=(1 if bias_shape[0] == "1" else B,
                            1 if bias_shape[1] == "1" else n, t, t)).astype(np.float32)
    mask = rng.random(size=(B, n, t, t)) < 0.6
    out = attend(q, k, v, mask=jnp.asarray(mask), bias=jnp.asarray(bias), impl=impl)
    w_expected, expected = np_attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)
    w = attention_weights(q, k, mask=jnp.asarray(mask), bias=jnp.asarray(bias))
    np.testing.assert_allclose(np.asarray(w), w_expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", BACKENDS)
def test_explicit_scale(rng, impl):
    q, k, v = random_qkv(rng, B, 8, 8, 4, 2)
    pos = random_positions(rng, B, 8)
    mask = np_causal(pos, pos)
    out = attend(q, k, v, mask=jnp.asarray(mask), impl=impl, scale=0.7)
    _, expected = np_attention(q, k, v, mask=mask, scale=0.7)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "packing", "causal+alibi"])
def test_cudnn_bf16_matches_reference(rng, kind):
    n, kv, t, h = 4, 2, 16, 64
    q, k, v = random_qkv(rng, B, t, t, n, kv, h=h, dtype=jnp.bfloat16)
    mask, bias = build_case(rng, kind, B, t, t, n)
    jmask, jbias = as_jnp(mask, bias)
    out = dot_product_attention(q, k, v, mask=jmask, bias=jbias, impl="cudnn")
    assert out.dtype == jnp.bfloat16
    f32 = [np.asarray(x.astype(jnp.float32)) for x in (q, k, v)]
    _, expected = np_attention(*f32, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected,
                               rtol=2e-2, atol=2e-2)


# ---- 4. softmax statistics in float32 --------------------------------------------------


@pytest.mark.parametrize("impl", BACKENDS)
def test_bfloat16_inputs_keep_float32_statistics(rng, impl):
    n, kv, t = 4, 2, 32
    q, k, v = random_qkv(rng, B, t, t, n, kv, dtype=jnp.bfloat16)
    q = q * 3  # sharper softmax: bf16 statistics would be visibly off
    mask, bias = build_case(rng, "causal+alibi", B, t, t, n)
    jmask, jbias = as_jnp(mask, bias)
    # The reference is computed from the same bf16-rounded inputs, in float64.
    qf, kf, vf = (np.asarray(x.astype(jnp.float32)) for x in (q, k, v))
    w_expected, expected = np_attention(qf, kf, vf, mask=mask, bias=bias)

    out = attend(q, k, v, mask=jmask, bias=jbias, impl=impl)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected,
                               rtol=1e-2, atol=1e-2)

    w = attention_weights(q, k, mask=jmask, bias=jbias)
    assert w.dtype == jnp.float32
    # bf16 x bf16 products are exact in float32: the weights are float32-accurate.
    np.testing.assert_allclose(np.asarray(w), w_expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)


# ---- 5. rows with nothing to attend to ------------------------------------------------


def fully_masked_case(rng, t, n):
    """Causal + padding where batch row 1 is all padding and row 0 has trailing padding."""
    seg = np.zeros((2, t), np.int32)
    seg[0, : int(rng.integers(1, t - 1))] = 1
    pos = np.tile(np.arange(t), (2, 1))
    mask = np_causal(pos, pos) & np_padding(seg, seg)
    bias = alibi_like_bias(rng, pos, pos, n)
    return mask, bias


@pytest.mark.parametrize("impl", BACKENDS)
def test_fully_masked_rows_give_zeros(rng, impl):
    n, kv, t = 4, 2, 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    mask, bias = fully_masked_case(rng, t, n)
    empty = ~mask.any(axis=-1)[:, 0]  # [B, Tq]: queries with no allowed key
    assert empty[1].all() and empty[0].any() and not empty[0].all()
    out = np.asarray(dot_product_attention(q, k, v, mask=jnp.asarray(mask),
                                           bias=jnp.asarray(bias), impl=impl))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[empty], 0.0)
    _, expected = np_attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)
    w = np.asarray(attention_weights(q, k, mask=jnp.asarray(mask), bias=jnp.asarray(bias)))
    assert np.isfinite(w).all()
    np.testing.assert_array_equal(w.transpose(0, 2, 1, 3)[empty], 0.0)


@pytest.mark.parametrize("impl", BACKENDS)
def test_gradient_finite_and_correct_with_fully_masked_rows(rng, impl):
    n, kv, t, h = 2, 1, 4, 4
    q, k, v = random_qkv(rng, 2, t, t, n, kv, h=h)
    mask, bias = fully_masked_case(rng, t, n)
    cot = rng.normal(size=(2, t, n, h))  # a random weighting of the outputs

    grads = [np.asarray(g) for g in attend_grads(q, k, v, cot, mask=jnp.asarray(mask),
                                                 bias=jnp.asarray(bias), impl=impl,
                                                 jit=True)[0]]  # shapes of its own
    for g in grads:
        assert np.isfinite(g).all()

    # Central differences of the float64 reference.
    args = [np.asarray(x, np.float64) for x in (q, k, v)]

    def np_loss(a):
        return np.sum(np_attention(*a, mask=mask, bias=bias)[1] * cot)

    eps = 1e-6
    for i, g in enumerate(grads):
        fd = np.zeros_like(args[i])
        for idx in np.ndindex(*args[i].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            fd[idx] = (np_loss(plus) - np_loss(minus)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-4, err_msg=f"grad {'qkv'[i]}")
    # A query that attends to nothing has no influence: zero gradient.
    empty = ~mask.any(axis=-1)[:, 0]
    np.testing.assert_array_equal(grads[0][empty], 0.0)


# ---- 6. GQA: grouping order without copying -----------------------------------------


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("n,kv", [(4, 2), (4, 1), (6, 3)])
def test_gqa_equals_mha_with_repeated_kv(rng, impl, n, kv):
    t = 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    mask, bias = build_case(rng, "causal+alibi", B, t, t, n)
    jmask, jbias = as_jnp(mask, bias)
    # Query head i reads kv head i // (N/K): repeat (not tile) along the head axis.
    k_rep, v_rep = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
    gqa = attend(q, k, v, mask=jmask, bias=jbias, impl=impl)
    mha = attend(q, k_rep, v_rep, mask=jmask, bias=jbias, impl=impl)
    np.testing.assert_allclose(np.asarray(gqa), np.asarray(mha), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(attention_weights(q, k, mask=jmask, bias=jbias)),
                               np.asarray(attention_weights(q, k_rep, mask=jmask, bias=jbias)),
                               rtol=1e-6, atol=1e-7)


def test_gqa_head_grouping_literal():
    """Two kv heads, four query heads: heads 0,1 see kv head 0 and heads 2,3 kv head 1."""
    q = jnp.zeros((1, 1, 4, 2), jnp.float32)  # uniform weights over the two keys
    k = jnp.zeros((1, 2, 2, 2), jnp.float32)
    v = jnp.asarray([[[1.0, 1.0], [100.0, 100.0]],
                     [[3.0, 3.0], [300.0, 300.0]]]).reshape(1, 2, 2, 2)  # [B, Tk, K, H]
    for impl in BACKENDS:
        out = np.asarray(attend(q, k, v, impl=impl))[0, 0, :, 0]
        np.testing.assert_allclose(out, [2.0, 2.0, 200.0, 200.0], rtol=1e-6)


# ---- 8. resolve / dispatch errors -----------------------------------------------------


def test_unknown_impl_raises_naming_allowed_values(rng):
    q, k, v = random_qkv(rng, 1, 2, 2, 2, 2)
    for call in (lambda: dot_product_attention(q, k, v, impl="flash"),
                 lambda: resolve_impl("flash", jnp.float32, H)):
        with pytest.raises(ValueError) as info:
            call()
        for name in ("auto", "reference", "xla", "cudnn"):
            assert name in str(info.value)
        assert "flash" in str(info.value)


def test_resolve_impl():
    assert {backends.AUTO, *backends.BACKENDS} == {"auto", "reference", "xla", "cudnn", "chunked",
                                                   "blockwise", "ring", "all_gather", "splash"}
    for impl in ("reference", "xla", "cudnn", "chunked", "blockwise"):
        assert resolve_impl(impl, jnp.float32, 64) == impl
    backend = jax.default_backend()
    other = {"cpu": "chunked"}.get(backend, "xla")
    assert resolve_impl("auto", jnp.float32, 64) == other
    assert resolve_impl("auto", jnp.bfloat16, 64) == ("cudnn" if backend == "gpu" else other)
    assert resolve_impl("auto", jnp.bfloat16, 60) == other  # head_dim % 8 != 0
    assert resolve_impl("auto", jnp.bfloat16, 256) == other  # head_dim > 128


def test_auto_goes_blockwise_past_the_dense_budget_and_says_why(capsys, monkeypatch):
    monkeypatch.setattr(backends, "_EXPLAINED", set())
    budget = backends.DENSE_LOGITS_BYTES
    assert resolve_impl("auto", jnp.float32, 64, logits_bytes=budget) != "blockwise"
    for _ in range(2):
        assert resolve_impl("auto", jnp.float32, 64, logits_bytes=budget + 4) == "blockwise"
    err = capsys.readouterr().err
    assert err.count("attention: auto chose blockwise: dense logits would take 1.0 GiB per "
                     "layer (> DENSE_LOGITS_BYTES = 1 GiB)") == 1  # once per process


def test_auto_by_platform_scheme_and_length(capsys, monkeypatch):
    """TPU: splash, or blockwise for a bias scheme; GPU: cuDNN for 16-bit inputs, but
    blockwise once a bias scheme's dense bias passes the budget; each choice explained."""
    monkeypatch.setattr(backends, "_EXPLAINED", set())
    big = backends.DENSE_LOGITS_BYTES + 4
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", jnp.bfloat16, 64, position="rope") == "splash"
    assert resolve_impl("auto", jnp.float32, 64, position="none", logits_bytes=big) == "splash"
    for position in ("alibi", "t5", "fire"):
        assert resolve_impl("auto", jnp.bfloat16, 64, position=position) == "blockwise"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", jnp.bfloat16, 64, position="alibi") == "cudnn"
    assert resolve_impl("auto", jnp.bfloat16, 64, position="rope", logits_bytes=big) == "cudnn"
    assert resolve_impl("auto", jnp.bfloat16, 64, position="t5", logits_bytes=big) == "blockwise"
    assert resolve_impl("auto", jnp.float32, 64, position="rope") == "xla"
    assert resolve_impl("auto", jnp.float32, 64, position="rope", logits_bytes=big) == "blockwise"
    err = capsys.readouterr().err
    assert "auto chose splash: a TPU, and no logit bias" in err
    assert "auto chose blockwise: a TPU, and position='fire' adds a logit bias, which the " \
        "splash kernel does not take" in err
    assert "and position='t5''s bias with them" in err


@pytest.mark.parametrize("impl", BACKENDS)
def test_query_heads_not_multiple_of_kv_heads_raises(rng, impl):
    q, k, v = random_qkv(rng, 1, 3, 3, 6, 4)
    with pytest.raises(ValueError, match="multiple"):
        dot_product_attention(q, k, v, impl=impl)
    with pytest.raises(ValueError, match="multiple"):
        attention_weights(q, k)


# ---- 9. logit soft-capping (Gemma 2: cap * tanh(s / cap) after the scale) --------------


SOFTCAP = 2.0
# every backend here that applies a soft-cap, by the table: given arrays, and given a rule
SOFTCAP_ARRAYS = [n for n in BACKENDS if backends.BACKENDS[n].takes_softcap]
SOFTCAP_RULES = [n for n in backends.backends_here() if backends.BACKENDS[n].takes_softcap]


def capped_qkv(rng, b, tq, tk, n, kv):
    """q and k of std 2 (logits of std ~4, so a cap of 2 binds), v of std 1."""
    q, k, v = random_qkv(rng, b, tq, tk, n, kv)
    return q * 2, k * 2, v


def two_segments(rng, t):
    """Segment ids [B, T]: two packed segments of random lengths (one may be empty; row 0's
    longer one has >= T/2 tokens, so the cap has keys to bind on), and 1 or 2 tokens of
    padding (id 0) at the end of row 1."""
    seg = np.sort(rng.integers(1, 3, (B, t)), axis=1)
    seg[1, t - int(rng.integers(1, 3)):] = 0
    return seg


def assert_far_from_plain(q, k, v, mask, bias, want, margin):
    """The answer `want` is more than `margin` from plain attention's (no cap, no sinks):
    the test would see the feature missing."""
    plain = np_attention(q, k, v, mask=mask, bias=bias)[1]
    assert np.abs(plain - want).max() > margin, np.abs(plain - want).max()


def assert_cap_binds(q, k, v, mask, bias, want):
    assert_far_from_plain(q, k, v, mask, bias, want, 0.3)


@pytest.mark.parametrize("impl", SOFTCAP_ARRAYS)
@pytest.mark.parametrize("is_causal", [True, False])
def test_softcap_output_and_gradients_match_float64(rng, impl, is_causal):
    """dot_product_attention(softcap=2): output, attention_weights, and the gradients of q,
    k, v and the bias against float64 NumPy, GQA 4:2, a packed and padded mask (padding
    rows have no key), causal (is_causal: chunked's blocked path) or not, an ALiBi-like
    bias."""
    n, kv, t = 4, 2, 8
    q, k, v = capped_qkv(rng, B, t, t, n, kv)
    seg, pos = two_segments(rng, t), np.broadcast_to(np.arange(t), (B, t))
    mask = np_segment(seg, seg)  # [B, 1, T, T]
    bias = alibi_like_bias(rng, pos, pos, n)  # [B, N, T, T]
    full_mask = np_index_causal(mask, t) if is_causal else mask
    jmask, jbias = as_jnp(mask, bias)
    d_out = rng.normal(size=(B, t, n, H)).astype(np.float32)
    w_want, want = np_attention(q, k, v, mask=full_mask, bias=bias, softcap=SOFTCAP)
    assert_cap_binds(q, k, v, full_mask, bias, want)

    got, out = attend_grads(q, k, v, d_out, mask=jmask, bias=jbias, bias_grad=True, impl=impl,
                            is_causal=is_causal, softcap=SOFTCAP)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    w = attention_weights(q, k, mask=jnp.asarray(full_mask), bias=jbias, softcap=SOFTCAP)
    np.testing.assert_allclose(np.asarray(w), w_want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip("q k v bias".split(), got, np_attention_grads(
            q, k, v, d_out, full_mask, bias, softcap=SOFTCAP)):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", SOFTCAP_RULES)
def test_softcap_through_rule_attention_matches_float64(rng, impl):
    """rule_attention(softcap=2), the model's path: a packed and padded causal rule and
    ALiBi as a LogitBias (where the backend adds a bias), GQA 4:2; output and gradients of
    q, k, v and the slopes against float64 NumPy."""
    from jaxformer.attention.masks import MaskRule
    from jaxformer.positions import alibi_bias, alibi_slopes, segment_positions
    from jaxformer.positions.schemes import LogitBias
    n, kv, t = 4, 2, 8
    q, k, v = capped_qkv(rng, B, t, t, n, kv)
    seg = two_segments(rng, t)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    mask = np_causal(pos, pos) & np.tril(np.ones((t, t), bool)) & np_segment(seg, seg)
    biased = backends.BACKENDS[impl].takes_bias
    slopes = jnp.asarray(alibi_slopes(n) * rng.uniform(0.5, 2.0, n), jnp.float32)
    dist = np.abs(pos[:, :, None] - pos[:, None, :])  # [B, T, S]
    bias = -np.asarray(slopes, np.float64)[None, :, None, None] * dist[:, None] \
        if biased else np.zeros((1,) * 4)
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg),
                    is_causal=True)
    d_out = rng.normal(size=(B, t, n, H)) * (seg > 0)[..., None, None]  # padding rows: 0
    want = np_attention(q, k, v, mask=mask, bias=bias, softcap=SOFTCAP)[1]
    assert_cap_binds(q, k, v, mask, bias, want)

    def loss(q, k, v, slopes):
        out = rule_attention(q, k, v, rule, LogitBias(alibi_bias, slopes) if biased else None,
                             impl=impl, softcap=SOFTCAP)
        return jnp.sum(out * d_out), out

    got, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, slopes)
    real = (seg > 0)[..., None, None]
    np.testing.assert_allclose(np.asarray(out) * real, want * real, rtol=1e-5, atol=2e-5)
    dq, dk, dv, d_logits = np_attention_grads(q, k, v, d_out, mask, bias, softcap=SOFTCAP)
    d_slopes = -np.einsum("bnts,bts->n", d_logits, dist)
    for name, g, w in zip("q k v slopes".split(), got, (dq, dk, dv, d_slopes)):
        if name == "slopes" and not biased:
            continue
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4, err_msg=name)


def test_cached_attention_softcap_matches_float64(rng):
    """A decode step over a KV cache (kv_cache.cached_attention, [B * K, S, H] rows) with
    softcap=2, a padding mask and a bias, GQA 4:2, against float64 NumPy."""
    from jaxformer.attention import kv_cache
    n, kv, tq, tk = 4, 2, 3, 8
    q, k, v = capped_qkv(rng, B, tq, tk, n, kv)
    k_seg = np.ones((B, tk), np.int32)
    k_seg[1, tk - int(rng.integers(1, 3)):] = 0  # padding: row 1's last query or two
    k_pos = random_positions(rng, B, tk)
    q_pos, q_seg = k_pos[:, tk - tq:], k_seg[:, tk - tq:]  # the last tq slots' tokens
    mask = np_causal(q_pos, k_pos) & np_padding(q_seg, k_seg)
    bias = alibi_like_bias(rng, q_pos, k_pos, n)
    rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(B * kv, tk, H)  # noqa: E731
    out = kv_cache.cached_attention(q, rows(k), rows(v), mask=jnp.asarray(mask),
                                    bias=jnp.asarray(bias), softcap=SOFTCAP)
    want = np_attention(q, k, v, mask=mask, bias=bias, softcap=SOFTCAP)[1]
    assert_cap_binds(q, k, v, mask, bias, want)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_softcap_on_a_backend_without_one_raises_naming_it(rng):
    """xla and cudnn (jax.nn.dot_product_attention) apply no cap: naming one with a
    softcap raises, naming it and the backends that do, whichever way in."""
    from jaxformer.attention.masks import MaskRule
    without = [n for n, b in backends.BACKENDS.items() if not b.takes_softcap]
    assert "xla" in without
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 1)
    pos = jnp.broadcast_to(jnp.arange(4), (1, 4))
    rule = MaskRule(pos, pos, is_causal=True, by_index=True)  # xla's by-index form too
    for impl in without:
        for call in (lambda: dot_product_attention(q, k, v, impl=impl, softcap=SOFTCAP),
                     lambda: rule_attention(q, k, v, rule, impl=impl, softcap=SOFTCAP),
                     lambda: resolve_impl(impl, jnp.float32, H, softcap=True)):
            with pytest.raises(ValueError) as info:
                call()
            message = str(info.value)
            assert f"{impl!r}" in message and "softcap" in message
            for name in backends.softcap_backends():
                assert name in message
        assert resolve_impl(impl, jnp.float32, H) == impl  # no cap: as before
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            dot_product_attention(q, k, v, impl="reference", softcap=bad)


def test_auto_with_softcap_picks_only_backends_that_take_it(capsys, monkeypatch):
    """Every setting `auto` decides from, on CPU, GPU and TPU, with a softcap: exactly one
    entry's rule answers (the rules themselves, not resolve_impl's guard), and it takes a
    softcap; on a GPU where xla or cudnn answer without a cap, chunked (dense logits within
    the budget) or blockwise (past it) answer with one, saying why."""
    monkeypatch.setattr(backends, "_EXPLAINED", set())
    big = backends.DENSE_LOGITS_BYTES + 4
    changed = set()
    for platform in ("cpu", "gpu", "tpu"):
        for dtype in (jnp.float32, jnp.bfloat16):
            for head_dim in (64, 60):
                for position in ("rope", "alibi"):
                    for logits_bytes in (0, big):
                        setting = backends.Setting(platform, dtype, head_dim, position,
                                                   logits_bytes, softcap=True)
                        answers = [n for n, b in backends.BACKENDS.items()
                                   if b.auto is not None and b.auto(setting) is not None]
                        assert len(answers) == 1, (setting, answers)
                        assert backends.BACKENDS[answers[0]].takes_softcap, (setting, answers)
                        plain = [n for n, b in backends.BACKENDS.items() if b.auto is not None
                                 and b.auto(backends.Setting(platform, dtype, head_dim,
                                                             position, logits_bytes)) is not None]
                        if plain != answers:
                            changed.add((platform, plain[0], answers[0]))
    assert changed == {("gpu", "xla", "chunked"), ("gpu", "cudnn", "chunked"),
                       ("gpu", "cudnn", "blockwise")}, changed
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", jnp.bfloat16, 64) == "cudnn"
    assert resolve_impl("auto", jnp.bfloat16, 64, softcap=True) == "chunked"
    assert resolve_impl("auto", jnp.float32, 64, softcap=True) == "chunked"
    assert resolve_impl("auto", jnp.bfloat16, 64, logits_bytes=big, softcap=True) == "blockwise"
    err = capsys.readouterr().err
    assert "auto chose chunked: the logits are soft-capped, which xla and cudnn" in err
    assert "auto chose blockwise: dense logits would take" in err and \
        "; the logits are soft-capped" in err


# ---- 10. attention sinks (gpt-oss: a logit per query head in every row's softmax) -----


SINK_ARRAYS = [n for n in BACKENDS if backends.BACKENDS[n].takes_sinks]
SINK_RULES = [n for n in backends.backends_here() if backends.BACKENDS[n].takes_sinks]


def random_sinks(rng, n):
    """Sinks of std 1 around 1: each holds a share of a row's weight that matters."""
    return rng.normal(1.0, 1.0, n).astype(np.float32)


def assert_sinks_matter(q, k, v, mask, bias, want):
    assert_far_from_plain(q, k, v, mask, bias, want, 0.1)


@pytest.mark.parametrize("impl", SINK_ARRAYS)
@pytest.mark.parametrize("is_causal", [True, False])
def test_sinks_output_and_gradients_match_float64(rng, impl, is_causal):
    """dot_product_attention(sinks=...): output, attention_weights and the gradients of q,
    k, v, the bias and the sinks against float64 NumPy; GQA 4:2, a packed and padded mask
    (padding rows have no key: all their weight on the sink, output 0), an ALiBi-like bias."""
    n, kv, t = 4, 2, 8
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    seg, pos = two_segments(rng, t), np.broadcast_to(np.arange(t), (B, t))
    mask = np_segment(seg, seg)
    bias = alibi_like_bias(rng, pos, pos, n)
    sinks = random_sinks(rng, n)
    full_mask = np_index_causal(mask, t) if is_causal else mask
    d_out = rng.normal(size=(B, t, n, H)).astype(np.float32)
    w_want, want = np_attention(q, k, v, mask=full_mask, bias=bias, sinks=sinks)
    assert_sinks_matter(q, k, v, full_mask, bias, want)

    def loss(q, k, v, bias, sinks):
        out = dot_product_attention(q, k, v, mask=jnp.asarray(mask), bias=bias, impl=impl,
                                    is_causal=is_causal, sinks=sinks)
        return jnp.sum(out * d_out), out

    got, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        q, k, v, jnp.asarray(bias), jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    w = attention_weights(q, k, mask=jnp.asarray(full_mask), bias=jnp.asarray(bias),
                          sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(w), w_want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip("q k v bias sinks".split(), got, np_attention_grads(
            q, k, v, d_out, full_mask, bias, sinks=sinks)):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", SINK_RULES)
def test_sinks_through_rule_attention_match_float64(rng, impl):
    """rule_attention(sinks=...), the model's path (blockwise a block at a time, the ring
    and all-gather on one device): a packed, padded, windowed causal rule, GQA 4:2; output
    and the gradients of q, k, v and the sinks against float64 NumPy."""
    from jaxformer.attention.masks import MaskRule
    from jaxformer.positions import segment_positions
    n, kv, t, window = 4, 2, 8, 3
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    seg = two_segments(rng, t)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    mask = np_causal(pos, pos) & np_segment(seg, seg) & np_window(pos, pos, window)
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg),
                    causal=True, window=window)
    sinks = random_sinks(rng, n)
    d_out = rng.normal(size=(B, t, n, H)) * (seg > 0)[..., None, None]  # padding rows: 0
    want = np_attention(q, k, v, mask=mask, sinks=sinks)[1]
    assert_sinks_matter(q, k, v, mask, None, want)

    def loss(q, k, v, sinks):
        out = rule_attention(q, k, v, rule, impl=impl, sinks=sinks)
        return jnp.sum(out * d_out), out

    got, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=2e-5)
    dq, dk, dv, _, d_sinks = np_attention_grads(q, k, v, d_out, mask, np.zeros((1,) * 4),
                                                sinks=sinks)
    for name, g, w in zip("q k v sinks".split(), got, (dq, dk, dv, d_sinks)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4, err_msg=name)


def test_cached_attention_sinks_match_float64(rng):
    """A decode step over a KV cache (kv_cache.cached_attention) with sinks, a padding mask
    and a bias, GQA 4:2, against float64 NumPy."""
    from jaxformer.attention import kv_cache
    n, kv, tq, tk = 4, 2, 3, 8
    q, k, v = random_qkv(rng, B, tq, tk, n, kv)
    k_seg = np.ones((B, tk), np.int32)
    k_seg[1, tk - int(rng.integers(1, 3)):] = 0
    k_pos = random_positions(rng, B, tk)
    q_pos, q_seg = k_pos[:, tk - tq:], k_seg[:, tk - tq:]
    mask = np_causal(q_pos, k_pos) & np_padding(q_seg, k_seg)
    bias = alibi_like_bias(rng, q_pos, k_pos, n)
    sinks = random_sinks(rng, n)
    rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(B * kv, tk, H)  # noqa: E731
    out = kv_cache.cached_attention(q, rows(k), rows(v), mask=jnp.asarray(mask),
                                    bias=jnp.asarray(bias), sinks=jnp.asarray(sinks))
    want = np_attention(q, k, v, mask=mask, bias=bias, sinks=sinks)[1]
    assert_sinks_matter(q, k, v, mask, bias, want)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_sinks_on_a_backend_without_them_raise_naming_it(rng):
    """xla, cudnn (jax.nn.dot_product_attention) and splash have no sinks: naming one with
    sinks raises, naming it and the backends that take them, whichever way in; a model
    config likewise, in one line."""
    from jaxformer.attention.masks import MaskRule
    from jaxformer.model.config import ConfigError, ModelConfig
    without = [n for n, b in backends.BACKENDS.items() if not b.takes_sinks]
    assert {"xla", "cudnn", "splash"} <= set(without)
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 1)
    sinks = jnp.zeros(2)
    pos = jnp.broadcast_to(jnp.arange(4), (1, 4))
    rule = MaskRule(pos, pos, is_causal=True, by_index=True)
    for impl in without:
        calls = [lambda: rule_attention(q, k, v, rule, impl=impl, sinks=sinks),
                 lambda: resolve_impl(impl, jnp.float32, H, sinks=True)]
        if backends.BACKENDS[impl].arrays is not None:
            calls.append(lambda: dot_product_attention(q, k, v, impl=impl, sinks=sinks))
        for call in calls:
            with pytest.raises(ValueError) as info:
                call()
            message = str(info.value)
            assert f"{impl!r}" in message and "sinks" in message
            assert all(name in message for name in backends.sink_backends())
        with pytest.raises(ConfigError, match=f"attention_impl='{impl}' has no attention sinks"):
            ModelConfig(attn_sinks=True, attention_impl=impl)


def test_auto_with_sinks_picks_only_backends_that_take_them():
    """Every setting `auto` decides from, on CPU, GPU and TPU, with sinks: exactly one
    entry's rule answers, and it takes sinks (on a TPU blockwise, not splash)."""
    big = backends.DENSE_LOGITS_BYTES + 4
    for platform in ("cpu", "gpu", "tpu"):
        for dtype in (jnp.float32, jnp.bfloat16):
            for position in ("rope", "alibi"):
                for logits_bytes in (0, big):
                    for window_as_data in (False, True):
                        setting = backends.Setting(platform, dtype, 64, position, logits_bytes,
                                                   window_as_data=window_as_data, sinks=True)
                        answers = [n for n, b in backends.BACKENDS.items()
                                   if b.auto is not None and b.auto(setting) is not None]
                        assert len(answers) == 1, (setting, answers)
                        assert backends.BACKENDS[answers[0]].takes_sinks, (setting, answers)
