"""Splash attention (jaxformer.attention.splash, Pallas interpret mode) against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.attention.reference import (np_attention, np_attention_grads, np_causal, np_segment,
                                       np_window, random_qkv)


@pytest.mark.parametrize("t, n, kv, window, packed", [(128, 4, 4, None, False),
                                                       (200, 4, 2, None, True),
                                                       (384, 4, 1, 37, False),
                                                       (512, 6, 2, 100, True)])
def test_splash_in_interpret_mode_matches_float64(rng, t, n, kv, window, packed):
    """jax's TPU splash kernel (Pallas interpret mode on CPU), handed the rule as
    CausalMask/LocalMask and SegmentIds, GQA/MQA native: output and q/k/v gradients
    against float64 NumPy with the dense mask; ragged T is padded inside; padding rows
    get zeros, as on every backend."""
    from jaxformer.attention.masks import MaskRule
    from jaxformer.attention.splash import splash_attention
    from jaxformer.positions import segment_positions
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
