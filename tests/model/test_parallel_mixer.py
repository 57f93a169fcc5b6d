"""A layer kind with a parallel mixer (model.layer_kinds.<kind>.parallel: a recurrent mixer
beside the attention on the same normed input, its output added; Falcon-H1's layers)
against its own full forward: a cache (prefill, padded prompts, one-token steps, keys and
state in one layer's entry) as the full forward, packed documents as apart, scanned with
remat as unscanned; its FLOPs; and the kinds refused in one line. Falcon-H1 against
transformers: tests/hf/test_falcon_h1.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.attention.kv_cache import init_cache
from jaxformer.core.validation import ConfigError
from jaxformer.model.mixers import mamba2
from jaxformer.model.transformer import flops_per_token
from tests.model import test_mixers as mixers
from tests.model.test_mixers import T, assert_close, logits_of, random_params, tokens_of

MAMBA = {"heads": 2, "head_dim": 8, "state": 8, "conv": 3, "chunk": 4, "norm": False,
         "in_multiplier": 0.7, "out_multiplier": 1.3,
         "part_multipliers": [1.2, 0.8, 1.1, 0.9, 1.5]}
KIND = {"parallel": "mamba2", "mixer_in_multiplier": 0.8, "mixer_out_multiplier": 1.2,
        "ffn_gate_multiplier": 1.4, "ffn_out_multiplier": 0.6}


def parallel(**kw) -> ModelConfig:
    """Four layers p p a p: attention with Mamba-2 beside it, and attention alone."""
    return ModelConfig(**{**dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64,
        max_seq_len=32, norm="rmsnorm", ffn="swiglu", layer_pattern=["p", "p", "a"],
        layer_kinds={"p": KIND, "a": {}}, mixer={"mamba2": MAMBA}), **kw})


CFG = parallel()


def test_cache_holds_keys_and_state_and_steps_equal_the_full_forward():
    """A prefill of 9 tokens then one-token steps, and right-padded prompts at three
    lengths: the full forward's logits (test_mixers' cached run)."""
    cache = init_cache(CFG, 3, T)["layers"]
    assert set(cache["block_0"]) == {"k", "v", "state", "conv"}
    assert set(cache["block_2"]) == {"k", "v"}
    params = random_params(CFG, mixers.rng)
    assert "parallel_mixer" in params["block_0"] and "parallel_mixer" not in params["block_2"]
    w, n = 9, T - 9
    tokens = tokens_of(3, T)
    lengths = np.array([w, *mixers.rng.integers(1, w, 2)], np.int32)
    plain, padded = mixers._cached_run(CFG, w, n)(params, jnp.asarray(tokens),
                                                  jnp.asarray(lengths))
    assert_close(np.asarray(plain), logits_of(CFG, params, tokens), what="plain prefill")
    real = tokens_of(3, T)
    for r in range(3):
        real[r, :lengths[r] + n] = np.concatenate([tokens[r, :lengths[r]], tokens[r, w:]])
    full = logits_of(CFG, params, real)
    want = np.stack([full[r, lengths[r] - 1 + np.arange(n)] for r in range(3)])
    assert_close(np.asarray(padded), want, what="padded prefill")


def test_packed_documents_read_as_each_alone():
    """Two documents and padding in each row: each document's logits as alone."""
    params = random_params(CFG, mixers.rng)
    first, second = 5, 6
    seg = np.repeat([1, 2, 0], [first, second, T - first - second])[None].repeat(3, 0)
    pos = np.concatenate([np.arange(first), np.arange(second), np.zeros(T - 11, int)])
    packed = tokens_of(3, T)
    got = logits_of(CFG, params, packed, pos[None].repeat(3, 0), seg)
    for start, stop in ((0, first), (first, first + second)):
        alone = tokens_of(3, T)
        alone[:, :stop - start] = packed[:, start:stop]
        assert_close(got[:, start:stop], logits_of(CFG, params, alone)[:, :stop - start])


def test_scanned_layers_equal_unscanned(monkeypatch):
    """Runs [p p] [a] [p]: test_mixers' scanned-with-remat check on this model."""
    assert [tuple(r)[1:] for r in CFG.layer_runs] == [(0, 2), (2, 3), (3, 4)]
    monkeypatch.setattr(mixers, "hybrid", lambda name, **kw: parallel(**kw))
    mixers.test_scanned_rematerialised_layers_equal_unscanned("mamba2")


def test_flops_count_the_parallel_mixer():
    """Three layers' Mamba-2 FLOPs beyond the same model without it."""
    plain = parallel(layer_kinds={"p": {}, "a": {}}, mixer=None)
    extra = 3 * mamba2.flops(CFG, CFG.mixer_settings("mamba2"), 64)
    assert flops_per_token(CFG, 64) == pytest.approx(flops_per_token(plain, 64) + extra)


@pytest.mark.parametrize("kind, match", [
    ({"parallel": "attention"}, "must be a recurrent mixer"),
    ({"mixer": "mamba2", "parallel": "mamba2"}, "runs beside attention"),
    ({"parallel": "lstm"}, "parallel"),
])
def test_a_bad_parallel_kind_is_refused_in_one_line(kind, match):
    with pytest.raises(ConfigError, match=match) as e:
        parallel(layer_kinds={"p": kind, "a": {}})
    assert "\n" not in str(e.value)


def test_an_ffn_gate_multiplier_on_experts_is_refused_at_the_config():
    """The mixture of experts has no dense gate to scale: one line when the config is built."""
    with pytest.raises(ConfigError) as e:
        ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, ffn="swiglu",
                    moe=dict(experts=4, top_k=2), layer_pattern=["a"],
                    layer_kinds={"a": {"ffn_gate_multiplier": 2.0}})
    assert "\n" not in str(e.value) and "model.layer_kinds.a.ffn_gate_multiplier" in str(e.value)
