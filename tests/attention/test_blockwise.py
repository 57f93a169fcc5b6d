"""jaxformer.attention.blockwise (and bf16 splash) against float64 NumPy, and its compiled skips."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.attention.reference import (B, np_attention, np_attention_grads, np_causal, np_segment,
                                       np_window, random_qkv)
from tests.conftest import DEFAULT_EMITTERS


def test_blockwise_skips_pass_only_block_sized_values_through_cond():
    """The compiled forward+backward, positions traced (packing, or any batch input):
    every lax.cond that skips a masked block carries block-sized values only. Handed the
    whole dK/dV accumulators, XLA:CPU copied them in and out at every block, and the
    backward ran 1.8x slower (bench/attention.py, T 2048)."""
    from jaxformer.attention.blockwise import blockwise_attention
    from jaxformer.attention.masks import MaskRule
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
    from jaxformer.attention.blockwise import blockwise_attention
    from jaxformer.attention.masks import MaskRule
    from jaxformer.attention.splash import splash_attention
    from jaxformer.positions import segment_positions
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
    from jaxformer.attention.blockwise import blockwise_attention
    from jaxformer.attention.masks import MaskRule
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
