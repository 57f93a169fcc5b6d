"""LoRA adapters (jaxformer.model.lora) against the update written out in float64, and training
with a frozen base."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.model import lora
from jaxformer.model.config import ConfigError
from jaxformer.training.step import TrainState, make_train_step, trained_part

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def small(**kw):
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                lora={"rank": 3, "alpha": 5.0})
    return ModelConfig(**{**base, **kw})


def init(cfg, random_b=True):
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)))
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    if random_b:  # B starts at 0; a random one makes the update show
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) * 0.1
            if p[-1].key == "lora_b" else x, params)
    return tokens, params


def merged_by_hand(params, cfg):
    """W + (alpha / r) A B in float64 for every adapter, written out; adapters dropped."""
    flat = flatten_dict(jax.device_get(params))
    out = {k: np.float64(v) for k, v in flat.items()
           if k[-1] not in ("lora_a", "lora_b", "lora_scale")}
    r = cfg.lora.rank
    for k, a in flat.items():
        if k[-1] != "lora_a":
            continue
        b = np.float64(flat[k[:-1] + ("lora_b",)])
        kernel = k[:-2] + (k[-2].removesuffix("_lora"), "kernel")
        w = out[kernel]
        layers = w.shape[:1] if cfg.scan_layers else ()
        for i in np.ndindex(*layers):
            a2 = np.float64(a[i]).reshape(-1, r)  # [in, r]
            b2 = b[i].reshape(r, -1)               # [r, out]
            w[i] += (cfg.lora.alpha / r) * (a2 @ b2).reshape(w[i].shape)
    return out


@pytest.mark.parametrize("kw", [dict(), dict(ffn="swiglu", scan_layers=True, remat="full"),
                                dict(lora={"rank": 2, "alpha": 7.0, "targets": "query,wo"})],
                         ids=["gelu", "swiglu-scanned", "two-targets"])
def test_forward_equals_the_merged_weights_in_float64(kw):
    cfg = small(**kw)
    tokens, params = init(cfg)
    ref = merged_by_hand(params, cfg)
    got = lora.merge(params)
    flat = flatten_dict(got)
    assert set(flat) == set(ref)
    for k in ref:
        np.testing.assert_allclose(flat[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
    plain = cfg.replace(lora=lora.LoRAConfig())
    ref_params = jax.tree.map(jnp.float32, unflatten_dict(ref))
    want = Transformer(plain).apply({"params": ref_params}, tokens)
    out = Transformer(cfg).apply({"params": params}, tokens)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(out - Transformer(plain).apply({"params": lora.partition(params, scales=True)[2]},
                                                         tokens))) > 1e-3  # the update shows


def _train(cfg, params, steps=3):
    tx = optax.apply_if_finite(optax.adamw(3e-2), 5)
    state = TrainState(step=jnp.zeros([], jnp.int32), params=params,
                       opt_state=tx.init(trained_part(params)[0]), rng=jax.random.PRNGKey(0))
    step = make_train_step(Transformer(cfg), tx, lambda s: 0.0)
    for i in range(steps):
        toks = rng.integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
        batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                 "loss_mask": np.ones((2, 12), np.float32)}
        state, m = step(state, batch)
    return state, m


@pytest.mark.parametrize("targets,moving", [
    ("all", {"query", "key", "value", "out", "wi", "wo"}), ("value,wi", {"value", "wi"})])
def test_training_moves_the_adapters_alone_by_updates_of_rank_r(targets, moving):
    cfg = small(lora={"rank": 2, "targets": targets})
    _, params = init(cfg, random_b=False)
    base_before = jax.device_get(lora.partition(params)[1])
    state, _ = _train(cfg, params)
    adapters, base = lora.partition(state.params)
    # the base, norms and embeddings included, is bitwise unchanged
    for (k, x), y in zip(flatten_dict(base_before).items(), flatten_dict(jax.device_get(base)).values()):
        assert np.array_equal(x, y), k
    # the optimizer holds moments for the adapters alone
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert opt_bytes == 2 * sum(x.nbytes for x in jax.tree.leaves(adapters))
    # merged: only the targets' kernels move, each by a delta of rank <= r (here == r)
    merged, before = flatten_dict(lora.merge(state.params)), flatten_dict(base_before)
    moved = {k[-2] for k in merged if not np.array_equal(merged[k], before[k])}
    assert moved == moving
    for k in merged:
        if k[-2] in moved and k[-1] == "kernel":
            d = np.float64(merged[k]) - before[k]
            n_in = 2 if k[-2] == "out" else 1
            assert np.linalg.matrix_rank(d.reshape(int(np.prod(d.shape[:n_in])), -1),
                                         tol=1e-6) == 2, k


def test_a_lora_model_decodes_as_its_merged_weights():
    cfg = small(position="alibi", sliding_window=5)
    tokens, params = init(cfg)
    plain = cfg.replace(lora=lora.LoRAConfig())
    merged = jax.tree.map(jnp.float32, lora.merge(params))
    kw = dict(max_new_tokens=6, rng=jax.random.key(1), temperature=0.0)
    a = generate(Transformer(cfg), params, tokens[:, :5], **kw)
    b = generate(Transformer(plain), merged, tokens[:, :5], **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="targets.*wq.*not a projection"):
        small(lora={"rank": 2, "targets": "wq"})
    with pytest.raises(ConfigError, match="wi, which a model with ffn=swiglu"):
        small(ffn="swiglu", lora={"rank": 2, "targets": "wi"})
    with pytest.raises(ConfigError, match="model.lora.rank"):
        small(lora={"rank": -1})
    assert not lora.partition(init(small(lora={"rank": 0}))[1])[0]  # rank 0: no adapters


@pytest.mark.parametrize("field, value, shown", [
    ("alpha", 8, "8"), ("dropout", 0.1, "0.1"), ("targets", "query,wo", "query,wo"),
    ("seed", 3, "3"), ("sweep_seeds", 2, "2")])
def test_a_lora_setting_without_a_rank_is_refused_in_one_line(field, value, shown):
    with pytest.raises(ConfigError) as e:
        lora.LoRAConfig.from_dict({field: value})
    assert str(e.value) == (f"model.lora.{field}={shown} is set but model.lora.rank=0 (no "
                            "adapters); set model.lora.rank")
    assert getattr(lora.LoRAConfig.from_dict({field: value, "rank": 2}), field) is not None
    default = lora.LoRAConfig().to_dict()  # a saved config.yaml lists every field
    assert lora.LoRAConfig.from_dict(default) == lora.LoRAConfig.from_dict(
        {**default, "targets": "all", "alpha": 16}) == lora.LoRAConfig()


def test_a_vmapped_sweep_equals_separate_runs_adapter_by_adapter():
    """Ranks 1 and 3 times seeds 0 and 1 (four adapters) trained as one vmapped step: the
    member (rank 1, seed 1), neither the first nor the widest (its adapters padded to rank
    3), equals its separate run over the same batches, losses and adapters step by step;
    the padding stays 0 and the rank-3 members train all their columns. Clipping at a norm
    the first step exceeds checks that the member is clipped by its own norm. (Each
    member's own alpha / r and fresh adapters: tests/training/test_sweep.py.)"""
    from jaxformer.training.optim import OptimConfig, make_optimizer
    from jaxformer.training.step import init_state

    cfg = small(lora={"sweep_rank": "1,3", "sweep_seeds": 2, "alpha": 4.0}, scan_layers=True,
                dropout=0.1)
    members = cfg.lora.members()
    assert [(m.rank, m.seed) for m in members] == [(1, 0), (1, 1), (3, 0), (3, 1)]
    # eps 1e-4: Adam divides by sqrt(v) + eps, and A's first gradients are ~0 (B = 0), whose
    # rounding would otherwise be blown up to a full step
    ocfg = OptimConfig(lr=3e-2, warmup_steps=0, clip_norm=0.05, eps=1e-4)
    batches = []
    for _ in range(3):
        toks = rng.integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
        batches.append({"inputs": toks[:, :-1], "targets": toks[:, 1:],
                        "loss_mask": np.ones((2, 12), np.float32)})

    def run(cfg):
        tx, schedule = make_optimizer(ocfg, cfg, 3)
        model = Transformer(cfg)
        state, step, out = init_state(model, tx, 7), make_train_step(model, tx, schedule), []
        for b in batches:
            state, m = step(state, b)
            out.append(np.asarray(m["loss"]))
        return np.stack(out, -1), state.params

    losses, params = run(cfg)
    assert losses.shape == (4, 3)
    i = 1  # (rank 1, seed 1): one compiled separate run
    alone_losses, alone = run(cfg.replace(lora=members[i]))
    np.testing.assert_allclose(losses[i], alone_losses, rtol=2e-6)
    got = flatten_dict(jax.device_get(lora.member(cfg.lora, params, i)[1]))
    for k, v in flatten_dict(jax.device_get(alone)).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=2e-6, err_msg=str((i, k)))
    # the padding stayed 0: members 0, 1 (rank 1) hold zeros in A's columns 1, 2, and
    # members 2, 3 (rank 3) moved theirs
    a = flatten_dict(jax.device_get(params))[("blocks", "attn", "query_lora", "lora_a")]
    assert a.shape[-1] == 3 and not a[:2, ..., 1:].any()
    assert all(a[m, ..., c].any() for m in (2, 3) for c in (1, 2))


def _dropout_masks():
    """An interceptor recording each nn.Dropout's keep mask (where its output is not 0; its
    input is random, so never 0) by the path of the module that called it, and the dict."""
    masks = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, nn.Dropout) and context.method_name == "__call__":
            masks[context.module.path[:-1]] = out != 0
        return out
    return record, masks


def _np_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_lora_dropout_drops_the_adapters_input_alone():
    """In training, an adapted projection is x W + b + (alpha / r) (dropout(x) A) B (PEFT's
    rule: the base path and the adapter's output undropped, kept inputs scaled by
    1 / (1 - p)), against that written out in float64 with the keep masks the layer drew:
    the feed-forward's wi and wo, and attention's query and out (two input axes)."""
    from jaxformer.model.blocks import FeedForward
    from jaxformer.model.self_attention import Attention
    p = float(rng.uniform(0.2, 0.6))
    cfg = small(lora={"rank": 3, "alpha": 5.0, "dropout": p, "targets": "query,out,wi,wo"})
    s, keep = 5.0 / 3, 1 / (1 - p)
    key = lambda: jax.random.key(int(rng.integers(1 << 30)))  # noqa: E731
    x = jnp.asarray(rng.standard_normal((2, 7, cfg.d_model)), jnp.float32)
    z = jnp.asarray(rng.standard_normal((2, 7, cfg.n_heads, cfg.head_dim)), jnp.float32)

    def run(module, *args, method):
        """module's method on args in training, jitted: its outputs in float64, its params
        (all random but lora_scale, alpha / r) and the keep masks it drew."""
        shapes = nn.unbox(jax.eval_shape(lambda: module.init(
            {"params": key(), "dropout": key()}, *args, method=method))["params"])
        params = jax.tree_util.tree_map_with_path(
            lambda path, v: np.float32(s) if path[-1].key == "lora_scale" else
            (rng.standard_normal(v.shape) * 0.3).astype(np.float32), shapes)

        @jax.jit
        def forward(params, *args):
            record, masks = _dropout_masks()
            with nn.intercept_methods(record):
                out = module.apply({"params": params}, *args, method=method,
                                   rngs={"dropout": key()})
            return out, masks

        out, masks = forward(params, *args)
        f64 = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
        return [np.asarray(o, np.float64) for o in out], f64, jax.device_get(masks)

    def adapted(x, w, b, ad, mask, n_in):  # x [B, T, in...] @ w [in..., out...]
        assert mask.shape == x.shape, f"dropout acts on {mask.shape}, not the input {x.shape}"
        assert mask.any() and not mask.all()
        base = np.tensordot(x, w, n_in) + b
        xa = np.tensordot(np.where(mask, x * keep, 0.0), ad["lora_a"], n_in)  # [B, T, r]
        return base + s * np.tensordot(xa, ad["lora_b"], 1)

    (y,), f, masks = run(FeedForward(cfg, deterministic=False), x,
                         method=lambda m, x: (m(x),))
    x64 = np.asarray(x, np.float64)
    h = _np_gelu(adapted(x64, f["wi"]["kernel"], f["wi"]["bias"], f["wi_lora"],
                         masks[("wi_lora",)], 1))
    want = adapted(h, f["wo"]["kernel"], f["wo"]["bias"], f["wo_lora"], masks[("wo_lora",)], 1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    (q, o), f, masks = run(Attention(cfg, deterministic=False), x, z,
                           method=lambda m, x, z: (m.projection("query", x),
                                                   m.projection("out", z)))
    np.testing.assert_allclose(q, adapted(x64, f["query"]["kernel"], f["query"]["bias"],
                                          f["query_lora"], masks[("query_lora",)], 1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, adapted(np.asarray(z, np.float64), f["out"]["kernel"],
                                          f["out"]["bias"], f["out_lora"],
                                          masks[("out_lora",)], 2), rtol=1e-5, atol=1e-5)
