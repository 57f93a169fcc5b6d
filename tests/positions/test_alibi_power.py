"""position=alibi_power: ALiBi's slopes on a power of the distance, -m_h |i - j|^p
(jaxformer.positions.biases), against float64 NumPy; the property tests parametrised over
POSITION_SCHEMES (causality, padding, packing, shift invariance, an encoder, the cached
forward, the backends) test the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.model.test_transformer as reference
from jaxformer import ConfigError, ModelConfig, Transformer
from jaxformer.positions import segment_positions
from jaxformer.positions.biases import alibi_power_bias

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def np_bias(n_heads, q_pos, k_pos, power):
    """-m_h |i - j|^p in float64, m_h = 2^(-8h/n) for h = 1..n (n a power of two: Press
    et al.'s geometric slopes)."""
    slopes = 2.0 ** (-8.0 * np.arange(1, n_heads + 1) / n_heads)
    distance = np.abs(q_pos[:, :, None] - k_pos[:, None, :]).astype(np.float64)
    return -slopes[None, :, None, None] * distance[:, None] ** power


@pytest.mark.parametrize("n_heads", [4, 8])
def test_bias_is_the_power_of_the_distance(n_heads):
    """Random positions (keys before and after the queries, far apart too) and a random
    power in (0, 2]: the bias equals the float64 formula."""
    power = float(rng.uniform(0.05, 2.0))
    q = rng.integers(0, 3000, (2, 7))
    k = rng.integers(0, 3000, (2, 11))
    slopes = 2.0 ** (-8.0 * np.arange(1, n_heads + 1) / n_heads)
    got = np.asarray(alibi_power_bias(jnp.asarray(slopes, jnp.float32), jnp.asarray(q),
                                      jnp.asarray(k), power))
    np.testing.assert_allclose(got, np_bias(n_heads, q, k, power), rtol=2e-5, atol=1e-6)


def test_model_matches_float64_forward():
    """A packed batch through the Transformer gives the float64 forward's logits
    (tests/model/test_transformer.py's reference, which the flag-combination and encoder
    tests compare every scheme with) at a random power; at power 1 it is ALiBi's model
    exactly."""
    power = float(rng.uniform(0.1, 2.0))
    cfg = reference.small(position="alibi_power", position_settings={"power": power},
                          n_kv_heads=2)
    tokens, params = reference.init(cfg, batch=2, seq=12)
    seg = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    got = reference.logits_of(cfg, params, tokens, positions=pos, segment_ids=seg)
    want = reference.np_forward(cfg, params, tokens, pos, seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], want[real], rtol=2e-4, atol=2e-4)
    linear = cfg.replace(position_settings={"power": 1.0})
    np.testing.assert_array_equal(reference.logits_of(linear, params, tokens),
                                  reference.logits_of(linear.replace(
                                      position="alibi", position_settings=None), params, tokens))


def test_power_is_checked_and_read_from_text():
    """power from the command line (a string) is a number; 0 and past 2 are refused in one
    line naming model.position_settings.power."""
    cfg = ModelConfig(position="alibi_power", position_settings={"power": "1.5"})
    assert cfg.position_settings.power == 1.5
    for bad in (0, 2.5):
        with pytest.raises(ConfigError, match=f"model.position_settings.power={bad}"):
            ModelConfig(position="alibi_power", position_settings={"power": bad})
    assert Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
