"""Llama 4's per-layer query settings (jaxformer.model.self_attention: query_temperature,
tuned_queries, Attention.qk_normed; LayerKind.qk_norm, temperature_floor/_scale; the l2
QK-norm of jaxformer.model.kinds.QK_NORMS) against float64 NumPy: each kind's queries and
keys as its settings say, with the kind static and traced (a scanned layer's)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import ModelConfig
from jaxformer.model.self_attention import Attention, query_temperature

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def np_temperature(p, floor, scale):
    return 1 + scale * np.log(1 + np.floor((p.astype(np.float64) + 1) / floor))


def test_query_temperature_is_the_formula():
    p = rng.integers(0, 100_000, (2, 9))
    floor, scale = int(rng.integers(1, 9000)), float(rng.uniform(0.05, 0.5))
    np.testing.assert_allclose(np.asarray(query_temperature(jnp.asarray(p), floor, scale)),
                               np_temperature(p, floor, scale), rtol=1e-6)


def test_each_kind_norms_and_tunes_its_queries_as_it_says():
    """A NoPE kind tuned (floor 3: the factor steps within 12 positions), unnormed; a
    NoPE kind normed by x / rms(x), untuned."""
    eps = 1e-5
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, norm_eps=eps, qk_norm="l2", layer_pattern=("tuned", "normed"),
                      layer_kinds={"tuned": dict(rope=False, qk_norm=False, temperature_floor=3,
                                                 temperature_scale=0.5),
                                   "normed": dict(rope=False)})
    attn = Attention(cfg)
    x = jnp.asarray(rng.normal(size=(2, 12, 32)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12)) + 5
    params = nn.unbox(attn.init(jax.random.key(0), x, pos, method=Attention.project))
    assert "q_norm" not in params["params"]  # the l2 norm has no weight
    w = {n: np.asarray(params["params"][n]["kernel"], np.float64) for n in ("query", "key")}
    raw = {n: np.einsum("btd,dnh->btnh", np.asarray(x, np.float64), w[n]) for n in w}
    l2 = {n: r / np.sqrt((r * r).mean(-1, keepdims=True) + eps) for n, r in raw.items()}
    want = {0: (raw["query"] * np_temperature(np.asarray(pos), 3, 0.5)[..., None, None],
                raw["key"]), 1: (l2["query"], l2["key"])}
    project = jax.jit(lambda kind: attn.apply(params, x, pos, kind, method=Attention.project))
    for kind in (0, 1):
        for got in (attn.apply(params, x, pos, kind, method=Attention.project),
                    project(jnp.int32(kind))):
            for g, wt in zip(got[:2], want[kind]):
                np.testing.assert_allclose(np.asarray(g), wt, rtol=2e-5, atol=2e-5)
