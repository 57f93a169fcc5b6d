"""The router that scales the experts' inputs (jaxformer.moe.experts ROUTERS sigmoid_input,
jaxformer.model.blocks.scaled_inputs; Llama 4's): a sparse layer's output against its
float64 NumPy definition, y = sum over the top-k logits j of expert_j(sigmoid(l_j) x) +
shared(x), under each dispatch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.model.blocks import MoEFeedForward
from jaxformer.moe.experts import MoEConfig

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def np_swiglu(x, gate, up, down):
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down


@pytest.mark.parametrize("dispatch", ["ragged", "dense", "capacity"])
def test_sigmoid_input_router_scales_each_experts_input(dispatch):
    moe = MoEConfig(experts=4, top_k=2, router="sigmoid_input", shared_experts=1,
                    shared_d_ff=16, dispatch=dispatch,
                    capacity_factor=8.0 if dispatch == "capacity" else None)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=24, moe=moe,
                      ffn="swiglu")
    layer = MoEFeedForward(cfg)
    x = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x))["params"]
    p = jax.tree.map(lambda a: np.asarray(a, np.float64) * 5, params)  # wider than init
    got = np.asarray(layer.apply({"params": jax.tree.map(jnp.float32, p)}, x))
    h = np.asarray(x, np.float64).reshape(14, 16)
    logits = h @ p["router"]["kernel"]
    want = np_swiglu(h, *(p["shared"][n]["kernel"] for n in ("wi_gate", "wi_up", "wo")))
    for i in range(14):
        for j in np.argsort(-logits[i])[:2]:
            scaled = h[i] / (1 + np.exp(-logits[i, j]))  # the input, not the output
            want[i] += np_swiglu(scaled, p["wi_gate"][j], p["wi_up"][j], p["wo"][j])
    np.testing.assert_allclose(got.reshape(14, 16), want, rtol=1e-5, atol=1e-5)
