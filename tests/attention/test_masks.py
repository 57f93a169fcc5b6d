"""The mask functions (jaxformer.attention.masks) against their NumPy definitions and literals."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model.self_attention import (causal_mask, make_attention_mask, padding_mask,
                                            segment_mask, sliding_window_mask)
from tests.attention.reference import B, np_causal, np_padding, np_segment, np_window

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
    if window is not None:  # without the causal rule (an encoder's) the window is symmetric
        expected &= np_window(q_pos, k_pos, window) if causal else \
            np.abs(q_pos[:, None, :, None] - k_pos[:, None, None, :]) < window
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
