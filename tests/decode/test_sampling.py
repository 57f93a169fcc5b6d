"""The sampling filters against transformers' logits warpers and their float64 definitions;
the filter table against the Sampling value that carries it. (Draws against their
distributions, by chi-square: tests/decode/test_loops.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.sampling import FILTERS, Sampling, filter_logits

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def test_every_filter_is_a_sampling_field_whose_default_is_off():
    """A filter is one entry of FILTERS: Sampling carries it (in the table's order, after the
    temperature) with its off value as the default, and at that value it keeps every
    logit: filter_logits gives the tempered logits (to float32 rounding: XLA:CPU may divide
    by a reciprocal), with every filter off (no sort) and with the filters run, one set to
    a value that keeps everything."""
    assert Sampling._fields == ("temperature", *FILTERS)
    assert Sampling._field_defaults == {"temperature": 1.0,
                                        **{n: f.off for n, f in FILTERS.items()}}
    logits = rng.normal(size=(3, 11)).astype(np.float32)
    t = np.float32(rng.uniform(0.3, 2.0))
    for keep_all in ({}, {"top_k": 11}, {"min_p": 1e-30}):
        got = filter_logits(jnp.asarray(logits), Sampling(t, **keep_all))
        np.testing.assert_allclose(got, logits.astype(np.float64) / t, rtol=3e-7,
                                   err_msg=str(keep_all))


def hf_filtered(logits, temperature, top_k, top_p, min_p):
    """transformers' warpers in the order its generate applies them (temperature, top-k,
    top-p, min-p), each left out at its off value as generate leaves it out."""
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    scores = torch.tensor(logits)[None]
    for w in warpers:
        scores = w(None, scores)
    return scores.numpy()[0]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (6, 1.0), (9, 0.8)])
def test_min_p_is_hfs_min_p_warper(top_k, top_p):
    """On random logits (no ties), with a random temperature and min_p per row, alone and
    after top-k / top-p: the same tokens kept, with the same tempered logits, as
    transformers' warpers applied in its generate's order. Min-p applied before the
    temperature, or before top-p, keeps other tokens."""
    b, v = 8, 50
    logits = (rng.normal(size=(b, v)) * rng.uniform(1, 4)).astype(np.float32)
    temperature = rng.uniform(0.4, 1.6, b).astype(np.float32)
    min_p = rng.uniform(0.02, 0.5, b).astype(np.float32)
    ours = np.asarray(filter_logits(jnp.asarray(logits), Sampling(
        jnp.asarray(temperature), top_k, top_p, jnp.asarray(min_p))))
    for r in range(b):
        hf = hf_filtered(logits[r], float(temperature[r]), top_k, top_p, float(min_p[r]))
        np.testing.assert_array_equal(np.isfinite(ours[r]), np.isfinite(hf), err_msg=str(r))
        kept = np.isfinite(hf)
        np.testing.assert_allclose(ours[r][kept], hf[kept], rtol=1e-6)
    assert (~np.isfinite(ours)).any()  # (min-p removed something)


def test_the_settings_may_be_keywords_as_before():
    """filter_logits(logits, temperature=, top_k=, top_p=, min_p=) (the form before Sampling)
    keeps what transformers' warpers keep; a Sampling and keywords together are refused."""
    logits = (rng.normal(size=(4, 30)) * 3).astype(np.float32)
    t, top_k, top_p, min_p = float(rng.uniform(0.5, 1.5)), 12, 0.9, 0.05
    ours = np.asarray(filter_logits(jnp.asarray(logits), temperature=t, top_k=top_k,
                                    top_p=top_p, min_p=min_p))
    for r in range(len(logits)):
        hf = hf_filtered(logits[r], t, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(ours[r]), np.isfinite(hf), err_msg=str(r))
    with pytest.raises(TypeError, match="not both"):
        filter_logits(jnp.asarray(logits), Sampling(), top_p=0.5)


def test_the_filters_run_without_a_sort():
    """top-k, top-p and min-p find their floors by a search over the values (a sort of a
    [32, 2048] block costs ~9 ms on XLA:CPU, more than the rest of a decode step): the
    compiled program of filter_logits holds no sort."""
    rows, vocab = 4, 64
    sampling = Sampling(np.full(rows, 0.8, np.float32), np.full(rows, 5, np.int32),
                        np.full(rows, 0.9, np.float32), np.full(rows, 0.05, np.float32))
    hlo = jax.jit(filter_logits).lower(jnp.zeros((rows, vocab)), sampling).compile().as_text()
    assert "sort(" not in hlo and "topk" not in hlo.lower()
