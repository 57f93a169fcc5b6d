"""The chunked backend (jaxformer.attention.chunked): its gradient's reductions in XLA:CPU's HLO."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxformer.attention import dot_product_attention
from tests.attention.reference import random_qkv
from tests.conftest import DEFAULT_EMITTERS


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
