"""Tests for jaxformer.attention.

Everything is checked against literal textbook numbers or against float64 NumPy
references written here (masks, softmax, grouped-query attention), on fresh random
inputs each run. Layout: q [B, Tq, N, H], k/v [B, Tk, K, H], masks [B, 1, Tq, Tk].
"""

import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxformer import backends, blockwise, chunked
from tests.conftest import DEFAULT_EMITTERS
from jaxformer.backends import rule_attention
from jaxformer.attention import (
    attention_weights,
    causal_mask,
    dot_product_attention,
    make_attention_mask,
    padding_mask,
    resolve_impl,
    segment_mask,
    sliding_window_mask,
)

# every backend that takes arrays and runs here (the table: a new entry is tested), but
# cuDNN: it takes 16-bit inputs alone, and these tests are float32 (its bf16 tests below)
BACKENDS = [n for n in backends.backends_here()
            if backends.BACKENDS[n].arrays is not None and n != "cudnn"]


@pytest.fixture(autouse=True)
def small_blocks(rng, monkeypatch):
    """Blockwise attention in blocks of a few rows and keys, so that these small inputs
    span several blocks (padding, skipping and the online softmax's rescaling)."""
    from jaxformer import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", int(rng.integers(2, 9)))
    monkeypatch.setattr(blockwise, "BLOCK_K", int(rng.integers(2, 9)))
# (query heads N, key/value heads K, Tq, Tk): every GQA ratio (K = N is MHA, K = 1 is MQA),
# self-attention (Tq = Tk) and decoding against a cache (Tq < Tk, query positions offset).
# Few distinct shapes, because each new one costs JAX a compilation.
CONFIGS = [(4, 4, 8, 8), (4, 2, 8, 8), (4, 2, 3, 8), (4, 1, 3, 8), (6, 3, 8, 8)]
B, H = 2, 8

# Every mask kind: "+" joins parts; windowW is sliding_window(W); alibi adds a bias.
MASK_KINDS = [
    "none",
    "causal",
    "padding",
    "packing",
    "window2",  # a window alone (no causal): everything ahead is allowed too
    "causal+window1",
    "causal+window3",
    "causal+window2+packing",
    "alibi",
    "causal+alibi",
    "packing+alibi",
]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Causal blocks of 3 query rows, so the chunked backend's block edges fall inside the
    short test sequences (8 keys: blocks of 3, 3 and 2)."""
    monkeypatch.setattr(chunked, "CHUNK", 3)


# ---- float64 NumPy definitions -----------------------------------------------------


def np_causal(q_pos, k_pos):
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def np_window(q_pos, k_pos, window):
    return (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < window


def np_padding(q_seg, k_seg):
    return (q_seg[:, None, :, None] != 0) & (k_seg[:, None, None, :] != 0)


def np_segment(q_seg, k_seg):
    same = q_seg[:, None, :, None] == k_seg[:, None, None, :]
    return same & np_padding(q_seg, k_seg)


def np_attention(q, k, v=None, mask=None, bias=None, scale=None, softcap=None):
    """Float64 softmax(cap(q k^T * scale) + bias, where mask) [v]; K/V repeated per group;
    cap(s) = softcap * tanh(s / softcap) if softcap (Gemma 2), else s.

    Returns the weights [B, N, Tq, Tk], and the output [B, Tq, N, H] when v is given.
    A row with no allowed key gets zero weights.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)  # query head n reads kv head n // group
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(logits - peak)
    total = e.sum(axis=-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    if v is None:
        return w
    v = np.repeat(np.asarray(v, np.float64), group, axis=2)
    return w, np.einsum("bnts,bsnh->btnh", w, v)


# ---- random inputs -----------------------------------------------------------------


def random_positions(rng, b, t):
    """Increasing positions with a random start and random gaps: [B, T]."""
    start = rng.integers(0, 50, size=(b, 1))
    return start + np.cumsum(rng.integers(1, 3, size=(b, t)), axis=1)


def padding_segments(rng, b, t):
    """Segment id 1 for a random-length prefix, then trailing zeros (padding)."""
    lengths = rng.integers(0, t, size=b)  # always some padding, sometimes all of it
    return (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)


def packed_segments(rng, b, t):
    """Random packing layouts: segments 1, 2, 3, ... of random lengths, then padding."""
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        used = int(rng.integers(t // 2, t + 1))
        n_cuts = int(rng.integers(0, min(3, used - 1) + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), size=n_cuts, replace=False))
        seg[i, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
    return seg


def positions_in_segments(seg):
    """Positions restart at 0 at each segment start (as packed training data has them)."""
    pos = np.zeros_like(seg)
    for i in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[i, t] = pos[i, t - 1] + 1 if seg[i, t] == seg[i, t - 1] else 0
    return pos


def alibi_like_bias(rng, q_pos, k_pos, n_heads):
    """-slope_n * |q - k| with random slopes, plus noise: [B, N, Tq, Tk] float32."""
    slopes = rng.uniform(0.05, 1.0, size=n_heads)
    dist = np.abs(q_pos[:, None, :, None] - k_pos[:, None, None, :])
    bias = -slopes[None, :, None, None] * dist + 0.1 * rng.normal(size=(1, n_heads, 1, 1))
    return bias.astype(np.float32)


def build_case(rng, kind, b, tq, tk, n_heads):
    """A NumPy mask [B, 1, Tq, Tk] (or None) and bias [B, N, Tq, Tk] (or None).

    Queries are the last Tq keys (positions and segments), so Tq < Tk is cached decoding.
    """
    parts = kind.split("+")
    k_pos, k_seg = random_positions(rng, b, tk), None
    if "padding" in parts:
        k_seg = padding_segments(rng, b, tk)
    if "packing" in parts:
        k_seg = packed_segments(rng, b, tk)
        k_pos = positions_in_segments(k_seg) + rng.integers(0, 5)
    q_pos = k_pos[:, tk - tq:]
    q_seg = None if k_seg is None else k_seg[:, tk - tq:]

    mask = np.ones((b, 1, tq, tk), bool)
    for part in parts:
        if part == "causal":
            mask &= np_causal(q_pos, k_pos)
        elif part.startswith("window"):
            mask &= np_window(q_pos, k_pos, int(part[len("window"):]))
        elif part == "padding":
            mask &= np_padding(q_seg, k_seg)
        elif part == "packing":
            mask &= np_segment(q_seg, k_seg)
    if set(parts) <= {"none", "alibi"}:
        mask = None
    bias = alibi_like_bias(rng, q_pos, k_pos, n_heads) if "alibi" in parts else None
    return mask, bias


def random_qkv(rng, b, tq, tk, n, kv, h=H, dtype=jnp.float32):
    q = rng.normal(size=(b, tq, n, h))
    k = rng.normal(size=(b, tk, kv, h))
    v = rng.normal(size=(b, tk, kv, h))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def as_jnp(mask, bias):
    return (None if mask is None else jnp.asarray(mask),
            None if bias is None else jnp.asarray(bias))


# ---- compiled calls -----------------------------------------------------------------
# The blockwise backend runs compiled, as a model runs it: called eagerly, each of its loops
# and conds is traced and compiled anew at every call. The others run eagerly unless asked
# (jit=True), their ops' programs cached per shape, which many cases share; a case of its
# own shapes compiles faster as one program. The inputs are arguments (a case's arrays are
# not baked into its program), so that cases of the same shapes share one program.


def _traced_settings(impl):
    """The module settings a backend reads when traced (blocks: the fixtures draw them per
    test), as a static argument: a cached program never serves another test's blocks."""
    return {"blockwise": (blockwise.BLOCK_Q, blockwise.BLOCK_K),
            "chunked": chunked.CHUNK}.get(impl)


def _compiled(fn, impl, jit):
    return fn if jit or (jit is None and impl == "blockwise") else fn.__wrapped__


_STATIC = ("impl", "is_causal", "scale", "softcap", "settings")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attend(q, k, v, mask, bias, *, impl, is_causal, scale, softcap, settings):
    del settings  # read by the backend from its module; here only to key the cache
    return dot_product_attention(q, k, v, mask=mask, bias=bias, impl=impl,
                                 is_causal=is_causal, scale=scale, softcap=softcap)


def attend(q, k, v, *, impl, mask=None, bias=None, is_causal=False, scale=None,
           softcap=None, jit=None):
    """dot_product_attention; jitted for blockwise or if jit."""
    return _compiled(_attend, impl, jit)(q, k, v, mask, bias, impl=impl, is_causal=is_causal,
                                         scale=scale, softcap=softcap,
                                         settings=_traced_settings(impl))


@functools.partial(jax.jit, static_argnames=_STATIC + ("argnums",))
def _attend_grads(q, k, v, mask, bias, d_out, *, argnums, impl, is_causal, scale, softcap,
                  settings):
    del settings

    def loss(q, k, v, bias):
        out = dot_product_attention(q, k, v, mask=mask, bias=bias, impl=impl,
                                    is_causal=is_causal, scale=scale, softcap=softcap)
        return jnp.sum(out * d_out), out

    return jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)


def attend_grads(q, k, v, d_out, *, impl, mask=None, bias=None, bias_grad=False,
                 is_causal=False, scale=None, softcap=None, jit=None):
    """The gradients of sum(dot_product_attention(...) * d_out) for q, k, v (and the bias
    if bias_grad), and the output: (grads, out); jitted for blockwise or if jit."""
    argnums = (0, 1, 2, 3) if bias_grad else (0, 1, 2)
    return _compiled(_attend_grads, impl, jit)(q, k, v, mask, bias, d_out, argnums=argnums,
                                               impl=impl, is_causal=is_causal, scale=scale,
                                               softcap=softcap,
                                               settings=_traced_settings(impl))


# ---- 1. textbook worked examples ------------------------------------------------------


@pytest.mark.parametrize("impl", BACKENDS)
def test_textbook_example_one_query_three_keys(impl):
    q = jnp.asarray([0.5, -0.3, 0.8, 0.1], jnp.float32).reshape(1, 1, 1, 4)
    k = jnp.asarray([[0.7, -0.2, 0.4, 0.3],
                     [0.1, 0.6, -0.5, 0.2],
                     [0.3, -0.4, 0.9, 0.7]], jnp.float32).reshape(1, 3, 1, 4)
    w = np.asarray(attention_weights(q, k))[0, 0, 0]
    # The book prints [0.371, 0.199, 0.431] (it rounds loosely: the scores are
    # [0.76, -0.51, 1.06] / 2, whose softmax is [0.37150, 0.19687, 0.43162]).
    np.testing.assert_allclose(w, [0.371, 0.199, 0.431], atol=2.5e-3)
    np.testing.assert_allclose(w, [0.37150, 0.19687, 0.43162], atol=1e-5)
    # Values = rows of the identity pick the weights out as the output (v has H = 4 too).
    v = jnp.eye(3, 4, dtype=jnp.float32).reshape(1, 3, 1, 4)
    z = np.asarray(dot_product_attention(q, k, v, impl=impl))[0, 0, 0]
    np.testing.assert_allclose(z, [0.37150, 0.19687, 0.43162, 0.0], atol=1e-5)


@pytest.mark.parametrize("impl", BACKENDS)
def test_textbook_example_two_by_two(impl):
    q = jnp.asarray([[1, 0], [0, 1]], jnp.float32).reshape(1, 2, 1, 2)
    k = jnp.asarray([[1, 0], [1, 1]], jnp.float32).reshape(1, 2, 1, 2)
    v = jnp.asarray([[10, 0], [0, 10]], jnp.float32).reshape(1, 2, 1, 2)
    a = np.asarray(attention_weights(q, k))[0, 0]
    z = np.asarray(dot_product_attention(q, k, v, impl=impl))[0, :, 0]
    np.testing.assert_allclose(a, [[0.5, 0.5], [0.330, 0.670]], atol=5e-4)  # 3 decimals
    np.testing.assert_allclose(z, [[5.0, 5.0], [3.30, 6.70]], atol=5e-3)  # 2 decimals


# ---- 2./3. every mask kind, GQA ratio and backend against the float64 reference -------


@pytest.mark.parametrize("n,kv,tq,tk", CONFIGS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_attention_weights_match_reference(rng, kind, n, kv, tq, tk):
    q, k, _ = random_qkv(rng, B, tq, tk, n, kv)
    mask, bias = build_case(rng, kind, B, tq, tk, n)
    jmask, jbias = as_jnp(mask, bias)
    w = attention_weights(q, k, mask=jmask, bias=jbias)
    assert w.dtype == jnp.float32 and w.shape == (B, n, tq, tk)
    np.testing.assert_allclose(np.asarray(w), np_attention(q, k, mask=mask, bias=bias),
                               rtol=1e-5, atol=1e-6)


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


def np_index_causal(mask, t):
    causal = np.tril(np.ones((t, t), bool))[None, None]
    return causal if mask is None else mask & causal


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


def np_attention_grads(q, k, v, d_out, mask, bias, scale=None, softcap=None):
    """Float64 gradients of sum(attention(q, k, v) * d_out) for q, k, v and the bias, from
    the softmax's Jacobian row by row: dlogits = w * (dw - sum_keys(w * dw)). The bias's
    gradient is summed over the axes it broadcasts along. With a softcap, q and k get
    dlogits * (1 - tanh(s / softcap)^2), s = q k^T * scale; the bias dlogits itself."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    w, _ = np_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                        softcap=softcap)  # [B, N, T, S]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    dw = np.einsum("btnh,bsnh->bnts", d_out, vr)
    d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))  # [B, N, T, S]
    ds = d_logits
    if softcap is not None:
        s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
        ds = d_logits * (1.0 - np.tanh(s / softcap) ** 2)
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    per_head = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], group, -1).sum(3)  # noqa: E731
    dk = per_head(np.einsum("bnts,btnh->bsnh", ds, q) * scale)
    dv = per_head(np.einsum("bnts,btnh->bsnh", w, d_out))
    axes = tuple(i for i in range(4) if np.shape(bias)[i] == 1)
    return dq, dk, dv, d_logits.sum(axis=axes, keepdims=True)


@pytest.mark.parametrize("t, n, kv, window, packed", [(128, 4, 4, None, False),
                                                       (200, 4, 2, None, True),
                                                       (384, 4, 1, 37, False),
                                                       (512, 6, 2, 100, True)])
def test_splash_in_interpret_mode_matches_float64(rng, t, n, kv, window, packed):
    """jax's TPU splash kernel (Pallas interpret mode on CPU), handed the rule as
    CausalMask/LocalMask and SegmentIds, GQA/MQA native: output and q/k/v gradients
    against float64 NumPy with the dense mask; ragged T is padded inside; padding rows
    get zeros, as on every backend."""
    from jaxformer.masks import MaskRule
    from jaxformer.positions import segment_positions
    from jaxformer.splash import splash_attention
    q, k, v = random_qkv(rng, 2, t, t, n, kv, h=64)
    seg = None
    if packed:
        seg = np.sort(rng.integers(1, 5, (2, t)), axis=1)
        seg[1, t - int(rng.integers(1, 30)):] = 0
        pos = np.asarray(segment_positions(jnp.asarray(seg)))
    else:
        pos = np.broadcast_to(np.arange(t), (2, t))
    mask = np_causal(pos, pos) & np.tril(np.ones((t, t), bool))
    if window is not None:
        mask &= np_window(pos, pos, window)
    if packed:
        mask &= np_segment(seg, seg)
    d_out = rng.normal(size=q.shape)
    want = np_attention(q, k, v, mask=mask)[1]
    jseg = None if seg is None else jnp.asarray(seg)
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jseg, jseg, window=window,
                    is_causal=True)
    loss = lambda q, k, v, rule, d_out: jnp.sum(  # noqa: E731
        splash_attention(q, k, v, rule) * d_out)
    out = jax.jit(splash_attention)(q, k, v, rule)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=2e-5)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, rule, d_out)
    for got, ref in zip(grads, np_attention_grads(q, k, v, d_out, mask, np.zeros((1,) * 4))[:3]):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_blockwise_skips_pass_only_block_sized_values_through_cond():
    """The compiled forward+backward, positions traced (packing, or any batch input):
    every lax.cond that skips a masked block carries block-sized values only. Handed the
    whole dK/dV accumulators, XLA:CPU copied them in and out at every block, and the
    backward ran 1.8x slower (bench/attention.py, T 2048)."""
    from jaxformer.blockwise import blockwise_attention
    from jaxformer.masks import MaskRule
    from jaxformer.positions import alibi_bias, alibi_slopes
    b, t, n, h = 1, 96, 2, 8
    q = jnp.ones((b, t, n, h))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    rule = MaskRule(pos, pos, is_causal=True, window=20)

    def loss(q, k, v, rule, slopes):
        return jnp.sum(blockwise_attention(q, k, v, rule, bias_fn=alibi_bias, bias_params=slopes,
                                           block_q=16, block_k=16))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4))).lower(
        q, q, q, rule, jnp.asarray(alibi_slopes(n))).compile(DEFAULT_EMITTERS).as_text()
    conds = [line.split(" conditional(")[0] for line in hlo.splitlines()
             if " conditional(" in line]
    assert len(conds) >= 2  # the forward's skip and the backward's
    for types in conds:
        dims = [int(d) for shape in re.findall(r"\[([\d,]*)\]", types)
                for d in shape.split(",") if d]
        assert max(dims) < t, types


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_structured_backends_in_bfloat16_output_and_gradients(rng, impl):
    """bf16 q/k/v through the rule backends (packed, padded, windowed; GQA): output and
    q/k/v gradients against float64 on the same bf16-rounded inputs, to bf16's precision."""
    from jaxformer.blockwise import blockwise_attention
    from jaxformer.masks import MaskRule
    from jaxformer.positions import segment_positions
    from jaxformer.splash import splash_attention
    t = int(rng.integers(130, 200)) if impl == "splash" else int(rng.integers(20, 40))
    q, k, v = random_qkv(rng, 2, t, t, 4, 2, h=32, dtype=jnp.bfloat16)
    seg = np.sort(rng.integers(1, 4, (2, t)), axis=1)
    seg[1, t - int(rng.integers(1, 9)):] = 0
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    window = int(rng.integers(3, 12))
    mask = np_causal(pos, pos) & np_window(pos, pos, window) & np_segment(seg, seg)
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg),
                    window=window, is_causal=True)
    attend = (lambda q, k, v, rule: blockwise_attention(q, k, v, rule, block_q=8, block_k=8)) \
        if impl == "blockwise" else splash_attention
    qf, kf, vf = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    d_out = rng.normal(size=q.shape)
    out = jax.jit(attend)(q, k, v, rule)
    assert out.dtype == jnp.bfloat16
    real = (seg > 0)[..., None, None]
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)) * real,
                               np_attention(qf, kf, vf, mask=mask)[1] * real, atol=3e-2)
    loss = lambda q, k, v, rule, d_out: jnp.sum(  # noqa: E731
        attend(q, k, v, rule).astype(jnp.float32) * d_out)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, rule, d_out)
    want = np_attention_grads(qf, kf, vf, d_out * real, mask, np.zeros((1,) * 4))[:3]
    for got, ref in zip(grads, want):
        assert got.dtype == jnp.bfloat16
        scale = np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), ref, atol=3e-2 * scale)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_rule_matches_float64(rng, window, packed):
    """Blockwise attention with the mask as a rule (positions, segment ids, window,
    causal) and ALiBi as (fn, slopes), over ragged T and several block shapes (so block
    edges fall everywhere, and some blocks are skipped): output and gradients of q, k, v
    and the slopes against float64 NumPy with the dense mask of the same positions."""
    from jaxformer.blockwise import blockwise_attention
    from jaxformer.masks import MaskRule
    from jaxformer.positions import alibi_bias, alibi_slopes, segment_positions
    n, kv = [(4, 2), (4, 1), (2, 2)][int(rng.integers(3))]
    t = int(rng.integers(9, 23))
    q, k, v = random_qkv(rng, B, t, t, n, kv)
    if packed:  # segments 1.., padding (0) at the end of row 1; positions restart
        seg = np.sort(rng.integers(1, 4, (B, t)), axis=1)
        seg[1, t - int(rng.integers(1, 4)):] = 0
        pos = np.asarray(segment_positions(jnp.asarray(seg)))
    else:  # increasing with gaps: positions are not indices
        seg, pos = None, np.cumsum(rng.integers(1, 3, (B, t)), axis=1)
    slopes = jnp.asarray(alibi_slopes(n) * rng.uniform(0.5, 2.0, n), jnp.float32)
    mask = np_causal(pos, pos) & np.tril(np.ones((t, t), bool))
    if window is not None:
        mask &= np_window(pos, pos, window)
    if packed:
        mask &= np_segment(seg, seg)
    bias = -np.asarray(slopes, np.float64)[None, :, None, None] * \
        np.abs(pos[:, None, :, None] - pos[:, None, None, :])
    d_out = rng.normal(size=q.shape)
    want = np_attention(q, k, v, mask=mask, bias=bias)[1]
    dq, dk, dv, ds = np_attention_grads(q, k, v, d_out, mask, bias)
    d_slopes = -np.einsum("bnts,bts->n", ds, np.abs(pos[:, :, None] - pos[:, None, :]))
    jseg = None if seg is None else jnp.asarray(seg)
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jseg, jseg, window=window,
                    is_causal=True)
    @functools.partial(jax.jit, static_argnames=("bq", "bk"))
    def grads_and_out(q, k, v, slopes, rule, d_out, *, bq, bk):
        def loss(q, k, v, slopes):
            out = blockwise_attention(q, k, v, rule, bias_fn=alibi_bias, bias_params=slopes,
                                      block_q=bq, block_k=bk)
            return jnp.sum(out * d_out), out
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, slopes)

    for bq, bk in [(3, 2), (2, 5), (4, 4), (t, 7)]:
        grads, out = grads_and_out(q, k, v, slopes, rule, d_out, bq=bq, bk=bk)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5, err_msg=(bq, bk))
        for got, ref in zip(grads, (dq, dk, dv, d_slopes)):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4,
                                       err_msg=(bq, bk))


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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's compiled HLO")
@pytest.mark.parametrize("kv", [3, 1])
def test_chunked_gradient_reduces_over_the_keys_only_in_the_forward(rng, kv):
    """The chunked backend's backward is written out: the softmax's Jacobian sums dO * O
    over head_dim, not dP * P over the keys. So the compiled gradient reduces a block's
    logits over the key axis only for the forward's row max and row sum, two per block
    (differentiated through the softmax, it took a third: 7.6 ms of a 34 ms layer at the
    bench shape)."""
    b, t, n, h = 2, 8, 3, 5  # blocks of 3 rows (small_chunks): 3 blocks, rows 3, 3, 2
    q, k, v = random_qkv(rng, b, t, t, n, kv, h=h)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, impl="chunked", is_causal=True) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile(DEFAULT_EMITTERS).as_text()
    per_row = re.compile(r"= f32\[%d,%d,%d,(3|2)\]\S* reduce\(.*dimensions=\{4\}"
                         % (b, kv, n // kv))  # [B, K, G, rows] from [B, K, G, rows, keys]
    found = [line.strip()[:100] for line in hlo.splitlines() if per_row.search(line)]
    assert len(found) == 2 * 3, found


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


# ---- 7. mask functions ------------------------------------------------------------------


def random_mask_inputs(rng, tq=5, tk=7):
    q_pos = rng.integers(0, 12, size=(B, tq))  # unsorted: masks are functions of positions
    k_pos = rng.integers(0, 12, size=(B, tk))
    q_seg = rng.integers(0, 4, size=(B, tq)).astype(np.int32)  # 0 = padding, anywhere
    k_seg = rng.integers(0, 4, size=(B, tk)).astype(np.int32)
    return q_pos, k_pos, q_seg, k_seg


def check_mask(got, expected):
    got = np.asarray(got)
    assert got.dtype == np.bool_ and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_mask_functions_match_numpy_definitions(rng):
    q_pos, k_pos, q_seg, k_seg = random_mask_inputs(rng)
    jq, jk, jqs, jks = (jnp.asarray(x) for x in (q_pos, k_pos, q_seg, k_seg))
    check_mask(causal_mask(jq, jk), np_causal(q_pos, k_pos))
    check_mask(padding_mask(jqs, jks), np_padding(q_seg, k_seg))
    check_mask(segment_mask(jqs, jks), np_segment(q_seg, k_seg))
    for window in (1, 2, 4):
        check_mask(sliding_window_mask(jq, jk, window), np_window(q_pos, k_pos, window))


def test_mask_literals():
    pos = jnp.arange(4)[None]
    seg = jnp.asarray([[1, 1, 2, 0]])
    np.testing.assert_array_equal(causal_mask(pos, pos)[0, 0], np.tril(np.ones((4, 4), bool)))
    # window 1 with causal = only itself; window 2 = itself and the one before
    np.testing.assert_array_equal(make_attention_mask(pos, pos, window=1)[0, 0], np.eye(4, dtype=bool))
    np.testing.assert_array_equal(make_attention_mask(pos, pos, window=2)[0, 0],
                                  np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool))
    np.testing.assert_array_equal(segment_mask(seg, seg)[0, 0],
                                  [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(padding_mask(seg, seg)[0, 0],
                                  [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("with_segments", [False, True])
def test_make_attention_mask_is_the_and_of_its_parts(rng, causal, window, with_segments):
    q_pos, k_pos, q_seg, k_seg = random_mask_inputs(rng)
    expected = np.ones((B, 1, q_pos.shape[1], k_pos.shape[1]), bool)
    if causal:
        expected &= np_causal(q_pos, k_pos)
    if window is not None:
        expected &= np_window(q_pos, k_pos, window)
    segs = (None, None)
    if with_segments:
        expected &= np_segment(q_seg, k_seg)
        segs = (jnp.asarray(q_seg), jnp.asarray(k_seg))
    got = make_attention_mask(jnp.asarray(q_pos), jnp.asarray(k_pos), *segs,
                              causal=causal, window=window)
    check_mask(got, expected)


def test_make_attention_mask_is_causal_by_default(rng):
    q_pos, k_pos, _, _ = random_mask_inputs(rng)
    check_mask(make_attention_mask(jnp.asarray(q_pos), jnp.asarray(k_pos)),
               np_causal(q_pos, k_pos))


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


def assert_cap_binds(q, k, v, mask, bias, want):
    """The capped answer is far from the uncapped one: the test would see a missing cap."""
    uncapped = np_attention(q, k, v, mask=mask, bias=bias)[1]
    assert np.abs(uncapped - want).max() > 0.3, np.abs(uncapped - want).max()


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
    from jaxformer.masks import MaskRule
    from jaxformer.positions import alibi_bias, alibi_slopes, segment_positions
    from jaxformer.schemes import LogitBias
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
    from jaxformer import kv_cache
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
    from jaxformer.masks import MaskRule
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
