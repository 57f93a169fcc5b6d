"""GatedDeltaMixer (jaxformer.model.mixers.gated_delta) against transformers'
Qwen3NextGatedDeltaNet: the same random weights (mapped by jaxformer.hf.gated_delta_layout's
rules, Qwen3-Next's grouped in_proj_qkvz / in_proj_ba), two key heads each shared by two
value heads, key and value widths apart, sequences longer than the convolution and than
a chunk (8), decays slow enough that the state carries across chunks.

- the full forward within 1e-5 relative, and a packed row: each segment as transformers
  runs it alone;
- cached: a prefill (one row right-padded) and one-token steps equal transformers' full
  forward of each row's real tokens.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextGatedDeltaNet)

from jaxformer import ModelConfig  # noqa: E402
from jaxformer.hf.gated_delta_layout import delta_rules, fused_projections  # noqa: E402
from jaxformer.model.mixers.gated_delta import GatedDeltaMixer, cache_shapes  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
D, T = 32, 20
SETTINGS = dict(heads=4, key_heads=2, key_dim=8, value_dim=6, conv=4, chunk=8)
CFG = ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, norm="rmsnorm_offset",
                  norm_eps=1e-6, ffn="swiglu", use_bias=False, position="none",
                  layer_pattern=["d", "a"], layer_kinds={"d": {"mixer": "gated_delta"},
                                                         "a": {}},
                  mixer={"gated_delta": SETTINGS})
MIXER = GatedDeltaMixer(CFG, CFG.mixer_settings("gated_delta"))
forward = jax.jit(MIXER.apply)


def torch_layer(seed: int):
    """transformers' layer of SETTINGS with random weights: projections at std 0.1, the
    convolution at 0.3, decay rates A in (0.02, 0.2) (the state lasts the sequence)."""
    config = transformers.Qwen3NextConfig(
        hidden_size=D, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, hidden_act="silu", num_hidden_layers=1,
        layer_types=["linear_attention"])
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = 0.3 if name.startswith("conv") else 0.1
            p.copy_(1 + std * torch.randn_like(p) if name.startswith("norm") else
                    std * torch.randn_like(p))
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.02, 0.2).log())
    return layer


def our_params(layer) -> dict:
    """The layer's weights as our params, through the HF rules."""
    state = {k: v.numpy() for k, v in layer.state_dict().items()}
    tree: dict = {}
    for rule in delta_rules(CFG, (), "", fused_projections):
        for path, value in zip(rule.ours, rule.to_ours(*[state[n] for n in rule.hf])):
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = jnp.asarray(value)
    return tree


def run_torch(layer, x):
    with torch.no_grad():
        return layer(torch.tensor(np.asarray(x, np.float32))).numpy()


def rel_err(ours, ref):
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def test_forward_matches_transformers_and_packing_restarts():
    layer = torch_layer(int(rng.integers(1 << 31)))
    params = our_params(layer)
    init = nn.meta.unbox(jax.eval_shape(MIXER.init, jax.random.key(0), jnp.zeros((1, T, D))))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, init["params"])
    x = rng.normal(size=(2, T, D)).astype(np.float32)
    cut = 9  # row 1 packs two documents: [0, cut) and [cut, T)
    segments = np.array([[1] * T, [1] * cut + [2] * (T - cut)], np.int32)
    got = np.asarray(forward({"params": params}, x, segments))
    assert rel_err(got[0], run_torch(layer, x[:1])[0]) < 1e-5
    for lo, hi in ((0, cut), (cut, T)):
        want = run_torch(layer, x[1:, lo:hi])[0]
        assert rel_err(got[1, lo:hi], want) < 1e-5, (lo, hi)


def test_cached_prefill_and_steps_match_the_full_forward():
    layer = torch_layer(int(rng.integers(1 << 31)))
    params = our_params(layer)
    prefill, steps, short = 11, 5, 7  # row 1's prompt: 7 real tokens, then padding
    x = rng.normal(size=(2, prefill + steps, D)).astype(np.float32)
    segments = np.array([[1] * prefill, [1] * short + [0] * (prefill - short)], np.int32)
    cache = {name: jnp.zeros((2, *shape), dtype or jnp.float32)
             for name, (shape, dtype) in cache_shapes(CFG, MIXER.settings).items()}
    out, cache = forward({"params": params}, x[:, :prefill], segments, cache)
    outs = [np.asarray(out)]
    step_x = np.concatenate([x[:1, prefill:], x[1:, short:short + steps]])  # [2, steps, D]
    for t in range(steps):
        out, cache = forward({"params": params}, step_x[:, t:t + 1], None, cache)
        outs.append(np.asarray(out))
    got = np.concatenate(outs, axis=1)  # [2, prefill + steps, D]
    assert rel_err(got[0], run_torch(layer, x[:1])[0]) < 1e-5
    want = run_torch(layer, np.concatenate([x[1:, :short], step_x[1:]], axis=1))[0]
    ours = np.concatenate([got[1, :short], got[1, prefill:]])
    assert rel_err(ours, want) < 1e-5
