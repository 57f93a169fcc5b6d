"""flat_dot_general against a float64 NumPy einsum, for every projection layout the model
uses and for the layouts it hands on to lax.dot_general unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.core.matmul import flat_dot_general

CASES = [  # lhs shape, rhs shape, dimension numbers, einsum of the same contraction
    ((2, 5, 8), (8, 6), (((2,), (0,)), ((), ())), "btd,df->btf"),            # Dense
    ((2, 5, 8), (8, 3, 4), (((2,), (0,)), ((), ())), "btd,dnh->btnh"),        # q/k/v
    ((2, 5, 3, 4), (3, 4, 8), (((2, 3), (0, 1)), ((), ())), "btnh,nhd->btd"),  # out
    ((2, 5, 8), (7, 8), (((2,), (1,)), ((), ())), "btd,vd->btv"),            # tied head
    ((2, 5, 8), (2, 8, 6), (((2,), (1,)), ((0,), (0,))), "btd,bdf->btf"),     # batched: as given
    ((5, 8), (6, 8, 3), (((1,), (1,)), ((), ())), "td,adc->tac"),            # middle axis: as given
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,spec", CASES)
def test_flat_dot_general_matches_einsum(lhs_shape, rhs_shape, dims, spec, rng):
    lhs, rhs = rng.normal(size=lhs_shape), rng.normal(size=rhs_shape)
    out = flat_dot_general(jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32), dims,
                           precision=jax.lax.Precision.HIGHEST)
    expected = np.einsum(spec, lhs, rhs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_preferred_element_type_and_gradients(rng):
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    assert flat_dot_general(x, w, dims, preferred_element_type=jnp.float32).dtype == jnp.float32
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    got = jax.grad(lambda a, b: jnp.sum(flat_dot_general(a, b, dims) * cot), (0, 1))(x32, w32)
    want = jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dims) * cot), (0, 1))(x32, w32)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
