"""jaxformer.attention.mla on its own: latent_attention (the absorbed form over a latent
cache) against multi-head attention written out in float64 NumPy over the expanded keys
k = [c W_uk, k_r] and values c W_uv, with masks, a bias, a softcap and sinks; MLAConfig's
own checks and check_model on a stand-in model config, each refusal one line. The model's
MLA (the expanded forward, decoding, the cache, configs through ModelConfig) is
tests/model/test_mla.py's."""

import dataclasses
import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.attention.mla import MLAConfig, default_scale, latent_attention
from jaxformer.core.validation import ConfigError


def np_mha(q, k, v, scale, mask=None, bias=None, softcap=None, sinks=None):
    """Float64 attention per head: q [B, T, N, D], k [B, S, N, D], v [B, S, N, E]."""
    logits = np.einsum("btnd,bsnd->bnts", q, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    extra = np.full(logits.shape[:-1] + (1,), -np.inf) if sinks is None else \
        np.broadcast_to(sinks[None, :, None, None], logits.shape[:-1] + (1,))
    both = np.concatenate([logits, extra], -1)
    peak = np.max(both, -1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(both - peak)
    total = e.sum(-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)[..., :-1]
    return np.einsum("bnts,bsne->btne", w, v)


@pytest.mark.parametrize("extras", ["none", "causal", "bias+softcap", "sinks+causal"])
def test_absorbed_form_equals_expanded_attention(rng, extras):
    b, t, s, n, r, nope, p, e = 2, 3, 7, 4, 6, 5, 4, 3
    c = rng.normal(size=(b, s, r))            # latents
    k_r = rng.normal(size=(b, s, p))          # the rotary key shared by the heads
    w_uk, w_uv = rng.normal(size=(r, n, nope)), rng.normal(size=(r, n, e))
    q_n, q_r = rng.normal(size=(b, t, n, nope)), rng.normal(size=(b, t, n, p))
    scale = 1 / math.sqrt(nope + p)
    k = np.concatenate([np.einsum("bsr,rnd->bsnd", c, w_uk),
                        np.broadcast_to(k_r[:, :, None], (b, s, n, p))], -1)
    v = np.einsum("bsr,rne->bsne", c, w_uv)
    kw, jkw = {}, {}
    if "causal" in extras:  # queries are the last t keys; one row may see only one key
        mask = (np.arange(s)[None, :] <= np.arange(s - t, s)[:, None])[None, None]
        mask = np.broadcast_to(mask, (b, 1, t, s)).copy()
        kw["mask"], jkw["mask"] = mask, jnp.asarray(mask)
    if "bias" in extras:
        bias = rng.normal(size=(b, n, t, s))
        kw["bias"], jkw["bias"] = bias, jnp.asarray(bias, jnp.float32)
        kw["softcap"] = jkw["softcap"] = float(rng.uniform(1, 3))
    if "sinks" in extras:
        sinks = rng.normal(size=n)
        kw["sinks"], jkw["sinks"] = sinks, jnp.asarray(sinks, jnp.float32)
    want = np_mha(np.concatenate([q_n, q_r], -1), k, v, scale, **kw)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    q_latent = np.einsum("btnd,rnd->btnr", q_n, w_uk)  # W_uk folded into the query
    got = latent_attention(f32(q_latent), f32(q_r), f32(c), f32(k_r), scale=scale, **jkw)
    assert got.shape == (b, t, n, r) and got.dtype == jnp.float32
    got = np.einsum("btnr,rne->btne", np.asarray(got, np.float64), w_uv)  # W_uv after
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_config_off_on_and_its_widths(rng):
    off = MLAConfig()
    assert not off.on and off.qk_head_dim == 0
    nope, rope = int(rng.integers(0, 64)), 2 * int(rng.integers(1, 32))
    on = MLAConfig(kv_lora_rank=int(rng.integers(1, 512)), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope, v_head_dim=int(rng.integers(1, 64)))
    assert on.on and on.qk_head_dim == nope + rope
    assert default_scale(on) == pytest.approx(1 / math.sqrt(nope + rope))
    assert MLAConfig.from_dict(on.to_dict()) == on
    # off, the other widths are free (a saved config's zeros, or left over)
    assert not MLAConfig(qk_rope_head_dim=3, v_head_dim=0).on


@pytest.mark.parametrize("change, says", [
    (dict(kv_lora_rank=-1), "model.mla.kv_lora_rank=-1 must be >= 0"),
    (dict(q_lora_rank=1.5), "model.mla.q_lora_rank=1.5 must be an int"),
    (dict(v_head_dim=True), "model.mla.v_head_dim=True must be an int"),
    (dict(qk_rope_head_dim=0), "model.mla.qk_rope_head_dim=0 must be >= 1 when "
                               "model.mla.kv_lora_rank=8 turns MLA on"),
    (dict(v_head_dim=0), "model.mla.v_head_dim=0 must be >= 1"),
    (dict(qk_rope_head_dim=3), "model.mla.qk_rope_head_dim=3 is odd"),
])
def test_bad_sections_are_one_line(change, says):
    base = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    with pytest.raises(ConfigError) as e:
        MLAConfig(**{**base, **change})
    assert "\n" not in str(e.value) and str(e.value).startswith(says), str(e.value)
    with pytest.raises(ConfigError, match="unknown model.mla field"):
        MLAConfig.from_dict({**base, "rank": 1})


MODEL = dict(head_dim=12, n_kv_heads=4, n_heads=4, position="rope", qk_norm="none",
             rope_fraction=1.0, p_rope=1.0, lora=types.SimpleNamespace(rank=0, targets=()))


@pytest.mark.parametrize("change, says", [
    (dict(head_dim=16), "model.head_dim=16 must be model.mla.qk_nope_head_dim + "
                        "qk_rope_head_dim = 8 + 4 = 12 (or unset)"),
    (dict(n_kv_heads=1), "model.n_kv_heads=1: MLA gives every head"),
    (dict(position="cope"), "model.position='cope' computes its logits"),
    (dict(rope_fraction=0.5), "model.rope_fraction=0.5 is not for MLA"),
    (dict(p_rope=0.75), "model.p_rope=0.75 is not for MLA"),
    (dict(lora=types.SimpleNamespace(rank=4, targets=("out", "value", "key"))),
     "model.lora.targets names value, key, which an MLA layer"),
])
def test_check_model_refuses_what_mla_cannot_take(change, says):
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    for position in ("rope", "alibi", "sinusoidal", "none"):  # what it takes
        mla.check_model(types.SimpleNamespace(**dict(MODEL, position=position)))
    mla.check_model(types.SimpleNamespace(**dict(
        MODEL, lora=types.SimpleNamespace(rank=0, targets=("query",)))))  # no LoRA: no refusal
    with pytest.raises(ConfigError) as e:
        mla.check_model(types.SimpleNamespace(**dict(MODEL, **change)))
    assert "\n" not in str(e.value) and str(e.value).startswith(says), str(e.value)


def test_section_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MLAConfig().kv_lora_rank = 1
