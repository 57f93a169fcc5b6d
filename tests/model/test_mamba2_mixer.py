"""jaxformer.model.mixers.mamba2: Mamba2Mixer against transformers' Mamba2Mixer (its torch
forward on CPU) with the same weights (moved by jaxformer.hf.mamba2_layout.mixer_rules),
the cached prefill and one-token steps against the full forward, packed segments against
each segment alone, and HF's parameter init."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from jaxformer import ModelConfig  # noqa: E402
from jaxformer.hf.mamba2_layout import mixer_rules  # noqa: E402
from jaxformer.model.mixers.mamba2 import Mamba2Mixer, Mamba2Settings, cache_shapes  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
D, T = 16, 19  # T: longer than the convolution and than two chunks
S = Mamba2Settings(heads=4, head_dim=4, groups=2, state=6, conv=3, chunk=8, bias=True,
                   dt_limit_low=0.01, dt_limit_high=0.5)
CFG = ModelConfig(vocab_size=32, d_model=D, n_layers=1, n_heads=2, norm="rmsnorm",
                  norm_eps=1e-5)
apply = jax.jit(Mamba2Mixer(CFG, S).apply)  # one program per shape, shared by the tests


def hf_mixer():
    """transformers' Mamba2Mixer of S's sizes, weights of std 0.3 (norm 1 + 0.3 noise),
    dt_bias around -1 so that the clamp binds on some steps."""
    config = transformers.Mamba2Config(
        hidden_size=D, num_heads=S.heads, head_dim=S.head_dim, n_groups=S.groups,
        state_size=S.state, conv_kernel=S.conv, chunk_size=S.chunk, expand=1,
        use_bias=S.bias, use_conv_bias=S.conv_bias, layer_norm_epsilon=CFG.norm_eps,
        time_step_limit=(S.dt_limit_low, S.dt_limit_high), num_hidden_layers=1)
    mixer = modeling_mamba2.Mamba2Mixer(config, layer_idx=0).eval()
    torch.manual_seed(int(rng.integers(1 << 31)))
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            shift = {"norm.weight": 1.0, "dt_bias": -1.0}.get(name, 0.0)
            p.copy_(0.3 * torch.randn_like(p) + shift)
    return mixer


def our_params(mixer):
    """The torch module's weights as our mixer's params."""
    state = {f"mixer.{k}": v.numpy() for k, v in mixer.state_dict().items()}
    params = {}
    for rule in mixer_rules(CFG, (), "mixer.", S):
        for path, arr in zip(rule.ours, rule.to_ours(*[state[n] for n in rule.hf])):
            node = params
            for key in path[1:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = jnp.asarray(arr)
    return params


def rel_err(ours, ref):
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def test_matches_transformers_mixer():
    mixer = hf_mixer()
    x = rng.normal(0, 1, (2, T, D)).astype(np.float32)
    with torch.no_grad():
        want = mixer(torch.tensor(x)).numpy()
    got = apply({"params": our_params(mixer)}, jnp.asarray(x))
    assert rel_err(got, want) < 1e-5, rel_err(got, want)


def test_cached_prefill_and_steps_equal_the_full_forward():
    params = {"params": our_params(hf_mixer())}
    x = jnp.asarray(rng.normal(0, 1, (2, T, D)), jnp.float32)
    full = apply(params, x)
    cache = {k: jnp.zeros((2, *shape), dtype or jnp.float32)
             for k, (shape, dtype) in cache_shapes(CFG, S).items()}
    prefill = 11  # more than one chunk
    y, cache = apply(params, x[:, :prefill], None, cache)
    outs = [y]
    for t in range(prefill, T):
        y, cache = apply(params, x[:, t:t + 1], None, cache)
        outs.append(y)
    assert rel_err(jnp.concatenate(outs, 1), np.asarray(full)) < 1e-5


def test_packed_segments_equal_each_segment_alone():
    params = {"params": our_params(hf_mixer())}
    x = jnp.asarray(rng.normal(0, 1, (1, T, D)), jnp.float32)
    ids = jnp.asarray([[1] * 9 + [2] * 9 + [0]])  # two segments of 9 (a chunk and one), a pad
    packed = np.asarray(apply(params, x, ids))[0, :18].reshape(2, 9, D)
    alone = np.asarray(apply(params, x[0, :18].reshape(2, 9, D)))  # each its own row
    assert rel_err(packed, alone) < 1e-5


def test_init_is_transformers_init():
    params = jax.jit(Mamba2Mixer(CFG, S).init)(jax.random.key(0), jnp.zeros((1, 4, D)))["params"]
    params = jax.tree.map(lambda p: np.asarray(getattr(p, "value", p)), params,
                          is_leaf=lambda p: hasattr(p, "value"))
    np.testing.assert_allclose(params["A_log"], np.log(np.arange(1, S.heads + 1)), rtol=1e-6)
    np.testing.assert_array_equal(params["D"], np.ones(S.heads))
    dt = np.log1p(np.exp(params["dt_bias"]))  # softplus undoes the inverse
    assert np.all((dt >= S.dt_min * (1 - 1e-5)) & (dt <= S.dt_max * (1 + 1e-5))), dt
    assert np.abs(params["conv"]).max() <= 1 / np.sqrt(S.conv)
