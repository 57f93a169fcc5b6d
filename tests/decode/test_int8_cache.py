"""Decoding over the int8 KV cache (jaxformer.attention.cache_formats; the format alone:
tests/attention/test_cache_formats.py): a cached forward over an int8 cache (GQA with a
ring, MLA's latent, scanned layers) against a full forward whose keys and values pass
through the same fake quantisation; speculative decoding's rollback over it. Fresh random
weights and inputs every run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Transformer
from jaxformer.attention import cache_formats
from jaxformer.attention.kv_cache import init_cache
from jaxformer.core.hooks import session
from jaxformer.decode.loops import generate
from jaxformer.model.inspect import run_with_hooks
from jaxformer.model.transformer import stack_layers
from tests.attention.test_cache_formats import MLA, make, np_quantised

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def fake_quantised(x):
    """x [..., H] through int8 and back (float32, x's dtype): what an int8 cache holds."""
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    q = jnp.clip(jnp.round(x / jnp.where(scale > 0, scale, 1)), -127, 127)
    return (q * scale).astype(x.dtype)


def recorder(names, then=lambda x: x):
    """Hooks at `names` that record each raw value (in `seen`, a list per name) and pass
    on then(value)."""
    seen = {n: [] for n in names}

    def hook(n):
        def fn(x):
            seen[n].append(x)
            return then(x)
        return fn

    return {n: hook(n) for n in names}, seen


@functools.partial(jax.jit, static_argnums=(0, 3, 5))
def cached_run(model, params, tokens, cuts, cache, names):
    """Logits [B, T, V] of a cached forward in chunks (cuts) then single steps, each
    forward's raw cached inputs at `names` ({name: [B, T, ...]}), and the cache."""
    t = tokens.shape[1]
    bounds = [*zip(cuts, cuts[1:]), *((i, i + 1) for i in range(cuts[-1], t))]
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    hooks, seen = recorder(names)
    out = []
    with session(hooks, lambda _: False):
        for a, b in bounds:
            logits, cache = model.apply({"params": params}, tokens[:, a:b], pos[:, a:b],
                                        cache=cache)
            out.append(logits)
    raw = {n: jnp.concatenate(v, 1) for n, v in seen.items()}
    return jnp.concatenate(out, 1), raw, cache


@functools.partial(jax.jit, static_argnums=(0, 3))
def reference_run(model, params, tokens, names):
    """A full forward with the keys and values at `names` fake-quantised, and their raw
    values there."""
    hooks, seen = recorder(names, fake_quantised)
    logits = run_with_hooks(model, params, tokens, hooks=hooks)
    return logits, {n: v[0] for n, v in seen.items()}


def tie_flipped(a, b):
    """Whether raw values a, b (one computed as a cached forward does, one as a full
    forward) may quantise to different integers somewhere: equal within float32 error
    there but quantised (in float64) apart, or a value within float32 rounding of a tie
    (x / scale = k + 1/2 to 3e-5: 95.4999996 went to 96 in one forward's float32 division
    and to 95 in the other's, seed 3802029974 under the tests' XLA flags)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    close = np.isclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())
    q, scale = np_quantised(b)
    units = np.abs(b) / np.where(scale > 0, scale, 1)
    near_tie = np.abs(units - np.floor(units) - 0.5) < 3e-5
    return bool(((np_quantised(a)[0] != q) & close).any() or near_tie.any())


CASES = {  # a GQA model whose first layer keeps a ring of w slots; MLA's latent cache
    "gqa_ring": (dict(layer_pattern=("local", "global"),
                      layer_kinds={"local": {"window": 3}, "global": {}}),
                 ("hook_rot_k", "hook_v")),
    "mla": (dict(mla=MLA, n_kv_heads=None, norm="rmsnorm", use_bias=False),
            ("hook_rot_k", "hook_kv_latent")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_int8_cached_forward_equals_full_forward_on_fake_quantised_kv(case):
    """Prefill in chunks (one longer than the ring), then single steps: the logits equal a
    full forward's whose cached keys and values are fake-quantised, within float32
    rounding. A draw where the two forwards' raw keys, equal within float32 error, quantise
    differently (a value at a rounding tie) is drawn again."""
    kw, hooks = CASES[case]
    model, params = make(int(rng.integers(1 << 30)), **kw)
    names = tuple(f"blocks.{i}.attn.{h}" for i in range(2) for h in hooks)
    for _ in range(4):
        tokens = jnp.asarray(rng.integers(0, 37, (2, 9)), jnp.int32)
        cache = init_cache(model.cfg, 2, 9, "int8", windowed=True)
        got, raw, cache = cached_run(model, params, tokens, (0, 5, 6), cache, names)
        want, ref_raw = reference_run(model, params, tokens, names)
        if not any(tie_flipped(raw[n], ref_raw[n]) for n in names):
            got, want = np.asarray(got), np.asarray(want)
            break
    else:
        pytest.fail("every draw had a rounding tie that the two forwards broke differently")
    assert isinstance(cache["layers"]["block_0"]["k"], cache_formats.Quantised)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * float(np.abs(want).max()))


def test_scanned_int8_cache_equals_the_unscanned_one():
    """Scanned layers ([L, ...] entries, values and scales) give the unscanned cache's
    logits and hold its int8 values and scales, stacked."""
    model, params = make(int(rng.integers(1 << 30)))
    scanned = Transformer(model.cfg.replace(scan_layers=True))
    tokens = jnp.asarray(rng.integers(0, 37, (2, 8)), jnp.int32)
    apply = jax.jit(lambda m, p, x, c: m.apply({"params": p}, x, cache=c), static_argnums=0)
    want, flat = apply(model, params, tokens, init_cache(model.cfg, 2, 8, "int8"))
    got, stacked = apply(scanned, stack_layers(params, 2), tokens,
                         init_cache(scanned.cfg, 2, 8, "int8"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    entry = stacked["layers"]["blocks"]["k"]
    assert entry.values.shape == (2, 4, 8, 8) and entry.scale.shape == (2, 4, 8, 1)
    for i in range(2):
        one = flat["layers"][f"block_{i}"]["k"]
        assert np.abs(np.asarray(entry.values[i], int) - np.asarray(one.values)).max() <= 1
        np.testing.assert_allclose(entry.scale[i], one.scale, rtol=1e-5)


def test_speculative_rollback_over_an_int8_ring_gives_plain_greedy_tokens():
    """Prompt lookup over an int8 cache (rings with spare slots, refused drafts rolled
    back) gives the tokens of plain greedy decoding over an int8 cache."""
    model, params = make(int(rng.integers(1 << 30)), layer_pattern=("local", "global"),
                         layer_kinds={"local": {"window": 3}, "global": {}})
    prompts = np.tile(rng.integers(1, 37, (2, 3)), (1, 3)).astype(np.int32)  # repeats: drafts
    run = functools.partial(generate, model, params, prompts, max_new_tokens=8,
                            rng=jax.random.key(0), temperature=0.0, cache_dtype="int8")
    plain, drafted = run(), run(draft="prompt_lookup", draft_len=3)
    assert int(np.sum(drafted.drafted)) > 0
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
