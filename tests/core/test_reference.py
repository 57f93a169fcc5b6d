"""The reference attention (jaxformer.core.reference: attention_weights, the definition every
backend answers to) and every backend against textbook numbers and float64 NumPy. The
attention tests' small blocks and chunks apply here too (tests/attention/conftest.py)."""

import numpy as np
import pytest

import jax.numpy as jnp

from jaxformer.attention import attention_weights, dot_product_attention
from tests.attention.conftest import small_blocks, small_chunks  # noqa: F401
from tests.attention.reference import (
    B,
    BACKENDS,
    CONFIGS,
    MASK_KINDS,
    as_jnp,
    build_case,
    np_attention,
    random_qkv,
)


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
