"""int8 and bfloat16 weights: the quantizer against a float64 NumPy one, the model's int8
logits against a float64 forward of the dequantized weights, and against float32 within
the stated bound; decoding reads them too. Fresh random weights every run."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxformer import ModelConfig, Transformer
from jaxformer.core.matmul import Int8Kernel
from jaxformer.decode import generate
from jaxformer.model.quantize import dequantize, quantize, quantize_int8, weight_bytes
from tests.conftest import DEFAULT_EMITTERS
from tests.model.test_transformer import np_forward

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
INT8_VS_FLOAT32 = 0.03  # stated bound: max |int8 logit - float32 logit| / max |float32 logit|


def make(**kw):
    cfg = ModelConfig(**{**dict(vocab_size=41, d_model=64, n_layers=2, n_heads=4,
                                n_kv_heads=2, max_seq_len=32), **kw})
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        jnp.zeros((1, 4), jnp.int32))["params"]
    return model, params


def test_int8_is_round_to_nearest_of_the_channel_absmax_over_127():
    w = rng.normal(size=(2, 6, 3, 5)) * rng.uniform(0.1, 3, (1, 1, 3, 5))  # [L, N, H, D]
    w[1, :, 0, 0] = 0.0  # an all-zero channel
    q = quantize_int8(w.astype(np.float32), contracted=2, stacked=True)
    w32 = w.astype(np.float32).astype(np.float64)
    scale = np.abs(w32).max(axis=(1, 2), keepdims=True) / 127  # [L, 1, 1, D]
    scale = np.where(scale > 0, scale, 1.0)
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    want = np.round(w32 / np.asarray(q.scale, np.float64))
    np.testing.assert_array_equal(q.values, want.astype(np.int8))
    assert q.values.dtype == np.int8 and np.abs(np.asarray(q.values, int)).max() == 127
    err = np.abs(np.asarray(q.dequantized(), np.float64) - w32)
    assert (err <= np.asarray(q.scale) / 2 * (1 + 1e-6)).all()  # half a step at most


@pytest.mark.parametrize("kw", [
    dict(), dict(ffn="swiglu", tie_embeddings=False, n_kv_heads=1),
    dict(scan_layers=True, block="post_ln", position="alibi", use_bias=False)])
def test_int8_logits_are_the_dequantized_models(kw):
    """The int8 forward against a float64 NumPy forward of values * scale (the weights it
    stands for) to float32 rounding, and against the float32 model within the bound."""
    model, params = make(**kw)
    q = quantize(params, "int8")
    kernels = [x for x in jax.tree.leaves(q, is_leaf=lambda x: isinstance(x, Int8Kernel))
               if isinstance(x, Int8Kernel)]
    assert len(kernels) == (4 + (3 if model.cfg.gated_ffn else 2)) * \
        (1 if model.cfg.scan_layers else model.cfg.n_layers) + (not model.cfg.tie_embeddings)
    assert weight_bytes(q) < 0.4 * weight_bytes(params)
    tokens = jnp.asarray(rng.integers(0, 41, (2, 11)), jnp.int32)
    got = np.asarray(jax.jit(model.apply)({"params": q}, tokens), np.float64)
    deq = jax.tree.map(lambda x: np.asarray(x.values, np.float64) * np.asarray(x.scale, np.float64)
                       if isinstance(x, Int8Kernel) else x, q,
                       is_leaf=lambda x: isinstance(x, Int8Kernel))
    if model.cfg.scan_layers:  # np_forward reads block_i
        from jaxformer.model.transformer import unstack_layers
        deq = unstack_layers(deq)
    want = np_forward(model.cfg, deq, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    full = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    assert np.abs(got - full).max() <= INT8_VS_FLOAT32 * np.abs(full).max()


def test_bfloat16_weights_are_the_rounded_models():
    model, params = make(ffn="geglu")
    b = quantize(params, "bfloat16")
    assert b["block_0"]["attn"]["query"]["kernel"].dtype == jnp.bfloat16
    assert b["embed"]["embedding"].dtype == jnp.bfloat16
    assert weight_bytes(b) < 0.55 * weight_bytes(params)
    tokens = jnp.asarray(rng.integers(0, 41, (2, 9)), jnp.int32)
    got = np.asarray(jax.jit(model.apply)({"params": b}, tokens), np.float64)
    want = np_forward(model.cfg, b, tokens)  # float64 of the bfloat16 values
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_decoding_reads_int8_weights():
    """Greedy from int8 params (plain and speculative) is greedy from their dequantized
    float32 weights."""
    model, params = make()
    params = jax.tree.map(lambda x: x * 3.0, params)  # sharp: no near-ties
    q = quantize(params, "int8")
    prompts = rng.integers(1, 41, (2, 5)).astype(np.int32)
    kw = dict(max_new_tokens=8, rng=jax.random.key(0), temperature=0.0)
    want = generate(model, dequantize(q), prompts, **kw).tokens
    np.testing.assert_array_equal(generate(model, q, prompts, **kw).tokens, want)
    np.testing.assert_array_equal(
        generate(model, q, prompts, **kw, draft="prompt_lookup").tokens, want)


def test_unknown_weight_format_is_an_error():
    with pytest.raises(ValueError, match="weights must be one of"):
        quantize({}, "int4")


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_the_decode_loop_reads_the_narrow_weights(weights):
    """In the compiled generate, the kernels enter the decode loop in their own dtype and
    no widened float32 copy of one is carried: XLA hoisted each conversion out of the loop
    once, which read float32 weights at every step and held a float32 copy beside them."""
    from jaxformer.decode.loops import _decoder
    from jaxformer.decode.sampling import Sampling, checked_sampling
    cfg = ModelConfig(vocab_size=41, d_model=96, d_ff=160, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=32)
    model = Transformer(cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    q = jax.eval_shape(lambda p: quantize(p, weights), shapes["params"])  # compiled, not run
    fn = _decoder(model.cfg, 4, None, 0, None, True)
    greedy = checked_sampling(Sampling(temperature=0.0), 1, model.cfg.vocab_size)
    hlo = fn.lower(q, jnp.zeros((1, 3), jnp.int32), jnp.array([3]), jax.random.key(0),
                   greedy).compile(DEFAULT_EMITTERS).as_text()
    # the states of the loops that carry a kernel (the decode loop; the sampler's own
    # loops, e.g. the random draw's, carry none)
    states = [s for s in re.findall(r"= \((.*?)\) while\(", hlo) if "[96,160]" in s]
    assert states, hlo
    narrow = "s8" if weights == "int8" else "bf16"
    for carried in states:
        assert f"{narrow}[96,160]" in carried and f"{narrow}[160,96]" in carried, carried
        assert "f32[96,160]" not in carried and "f32[160,96]" not in carried, carried


# the bfloat16 rule, by path: projection kernels (not an adapter's) and the token table
PROJECTIONS = ("query", "key", "value", "out", "wi", "wi_gate", "wi_up", "wo", "lm_head")


@pytest.mark.parametrize("kw", [
    dict(position="learned", ffn="swiglu", scan_layers=True),
    dict(position="fire"), dict(position="t5", qk_norm="head"), dict(position="kerple"),
    dict(position="cope", block="sandwich")], ids=lambda kw: kw["position"])
def test_bfloat16_casts_the_kernels_and_token_table_alone(kw):
    """Every leaf of a model with biases, norms, position params, an untied head and LoRA
    adapters, against the rule written out by path: projection kernels and embed/embedding
    become bfloat16 (rounded: within 2^-8 relative), all else stays float32, bit for bit."""
    cfg = ModelConfig(**{**dict(vocab_size=41, d_model=16, n_layers=2, n_heads=2,
                                max_seq_len=16, use_bias=True, tie_embeddings=False,
                                lora={"rank": 2}), **kw})
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0),
                            jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    got = flatten_dict(quantize(params, "bfloat16"))
    seen = set()
    for path, x in flatten_dict(params).items():
        y = np.asarray(got[path])
        narrow = (path[-1] == "kernel" and path[-2] in PROJECTIONS) or \
            path[-2:] == ("embed", "embedding")
        kind = ("narrow" if narrow else "adapter" if path[-2].endswith("_lora") else
                "norm" if path[-2].endswith("norm") else "bias" if path[-1] == "bias" else
                "position" if path[-2] in ("pos_embed", "position_bias") or
                path[-1] == "cope_embedding" else path)
        seen.add(kind)
        if narrow:
            assert y.dtype == jnp.bfloat16, path
            err = np.abs(np.float64(y) - x)
            assert (err <= 2.0 ** -8 * np.abs(x)).all(), path
        else:
            assert y.dtype == np.float32 and np.array_equal(y, x), (path, y.dtype)
    assert seen == {"narrow", "adapter", "norm", "bias", "position"}
