"""ShortConvMixer (LFM2's gated short convolution) against transformers' Lfm2ShortConv with
the same weights: the full forward, a packed row against its segments alone, and a cached
prefill of right-padded rows followed by one-token steps."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv  # noqa: E402

from jaxformer import ModelConfig  # noqa: E402
from jaxformer.model.mixers.short_conv import ShortConvMixer, ShortConvSettings  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
D, K = 16, 4  # width and taps: every sequence below is longer than the kernel
CFG = ModelConfig(vocab_size=8, d_model=D, n_layers=2, n_heads=2, norm="rmsnorm", ffn="swiglu")
SETTINGS = ShortConvSettings(kernel=K, bias=True)
MIXER = ShortConvMixer(CFG, SETTINGS)
APPLY = jax.jit(MIXER.apply)


def torch_mixer():
    """transformers' Lfm2ShortConv (kernel K, biases) with weights of std 0.3, and its
    weights as our params (in_proj in thirds B, C, x; conv [D, 1, K] as [K, D])."""
    config = transformers.Lfm2Config(hidden_size=D, num_hidden_layers=1, conv_L_cache=K,
                                     conv_bias=True, layer_types=["conv"])
    module = Lfm2ShortConv(config, 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.normal(0, 0.3, p.shape).astype(np.float32)))
    w = {n: p.detach().numpy() for n, p in module.named_parameters()}
    b, c, x = np.split(w["in_proj.weight"], 3)  # [D, D] each, [out, in]
    bb, bc, bx = np.split(w["in_proj.bias"], 3)
    params = {"in_b": {"kernel": b.T, "bias": bb}, "in_c": {"kernel": c.T, "bias": bc},
              "in_x": {"kernel": x.T, "bias": bx},
              "conv": w["conv.weight"][:, 0, :].T, "conv_bias": w["conv.bias"],
              "out": {"kernel": w["out_proj.weight"].T, "bias": w["out_proj.bias"]}}
    return module, {"params": jax.tree.map(jnp.asarray, params)}


def reference(module, x):
    """transformers' output on x [B, T, D] (no cache, no mask)."""
    with torch.no_grad():
        return module(torch.from_numpy(np.asarray(x, np.float32))).numpy()


def close(got, want, tol=1e-5):
    err = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
    assert err < tol, err


def test_matches_transformers():
    module, params = torch_mixer()
    x = rng.normal(size=(2, 11, D)).astype(np.float32)
    close(APPLY(params, x), reference(module, x))


def test_packed_row_equals_its_segments_alone():
    module, params = torch_mixer()
    lengths = (5, 1, 6)  # a one-token segment among longer ones; then 2 padding tokens
    x = rng.normal(size=(1, sum(lengths) + 2, D)).astype(np.float32)
    seg = np.repeat(np.arange(1, 4), lengths)
    seg = np.concatenate([seg, [0, 0]])[None]  # [1, T]
    got = np.asarray(APPLY(params, x, seg))
    start = 0
    for n in lengths:
        close(got[:, start:start + n], reference(module, x[:, start:start + n]))
        start += n


def test_cached_prefill_then_steps_equal_the_full_forward():
    """Right-padded prompts of 7 and 2 real tokens (2 < K - 1: the cache holds zeros
    before them), then 3 one-token steps: each row's outputs are transformers' on its real
    tokens followed by the steps."""
    module, params = torch_mixer()
    lengths, t, steps = (7, 2), 7, 3
    x = rng.normal(size=(2, t, D)).astype(np.float32)
    seg = (np.arange(t)[None] < np.array(lengths)[:, None]).astype(np.int32)  # [2, T]
    new = rng.normal(size=(2, steps, D)).astype(np.float32)
    cache = {"conv": jnp.zeros((2, K - 1, D), jnp.float32)}
    prefill, cache = APPLY(params, x, seg, cache)
    outs = []
    for s in range(steps):
        y, cache = APPLY(params, new[:, s:s + 1], np.ones((2, 1), np.int32), cache)
        outs.append(np.asarray(y))
    for row, n in enumerate(lengths):
        want = reference(module, np.concatenate([x[row:row + 1, :n], new[row:row + 1]], 1))
        got = np.concatenate([np.asarray(prefill)[row:row + 1, :n],
                              *[o[row:row + 1] for o in outs]], 1)
        close(got, want)
