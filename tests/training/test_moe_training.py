"""Mixture-of-experts training: the balancing losses enter the gradient, the step's MoE
metrics are the routing's own counts, DeepSeek-V3's bias update balances a skewed router
and survives a resume bit for bit, and evaluation reports the cross entropy alone.
The references read the router from the hook points (jaxformer.model.inspect) and count by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer.model.config import ConfigError
from jaxformer.model.inspect import run_with_cache
from jaxformer.model.transformer import Transformer
from jaxformer.training import load_config, loop
from jaxformer.training.metrics import read_metrics
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import init_state, make_train_step
from tests.conftest import REPO
from tests.training.test_loop import (TINY, config, corpus, hand_val_loss, losses,  # noqa: F401
                                      np_nll, random_batch, restored_state,
                                      resumed_like_straight, same_saved_state)

E, K = 4, 2  # experts, and how many each token reaches
MOE = [f"model.moe.experts={E}", f"model.moe.top_k={K}"]


def moe_setup(*overrides, tx=None):
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [*TINY, *MOE, *overrides])
    model = Transformer(cfg.model)
    if tx is None:
        return cfg.model, model, *make_optimizer(cfg.optim, cfg.model, 40)
    return cfg.model, model, tx, lambda step: 1.0


def router_cache(model, params, inputs):
    """(logits, {layer: (router logits [N, E], chosen experts [N, k])}) for each sparse layer.
    The router's logits are hooked as gate.hook_out (TransformerLens's name) or, before it,
    hook_router_logits."""
    logits, cache = run_with_cache(model, params, inputs, names=lambda n: ".mlp." in n)
    ids = [i for i, s in enumerate(model.cfg.sparse_layers) if s]

    def router_logits(i):
        name = f"blocks.{i}.mlp.gate.hook_out"
        return cache[name if name in cache else f"blocks.{i}.mlp.hook_router_logits"]

    return logits, {i: (router_logits(i).reshape(-1, E),
                        cache[f"blocks.{i}.mlp.hook_expert_indices"].reshape(-1, K))
                    for i in ids}


def reference_train_loss(model, params, micro, aux_loss, z_loss):
    """The train loss by its definition: over the micro-batches, the summed cross entropy
    plus count x (aux_loss x the mean over sparse layers of E sum_e f_e p_e + z_loss x the
    mean of logsumexp(router logits)^2), all over the total count; f_e the share of the
    micro-batch's assignments to e, p_e its mean softmax probability."""
    out, total = 0.0, sum(jnp.sum(mb["loss_mask"]) for mb in micro)
    for mb in micro:
        logits, routers = router_cache(model, params, mb["inputs"])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, mb["targets"][..., None], -1)[..., 0]
        aux = [E * jnp.sum(jnp.bincount(idx.reshape(-1), length=E) / idx.size
                           * jnp.mean(jax.nn.softmax(rl), 0)) for rl, idx in routers.values()]
        z = [jnp.mean(jax.nn.logsumexp(rl, -1) ** 2) for rl, _ in routers.values()]
        count = jnp.sum(mb["loss_mask"])
        out += jnp.sum(nll * mb["loss_mask"]) + count * (aux_loss * jnp.mean(jnp.stack(aux))
                                                          + z_loss * jnp.mean(jnp.stack(z)))
    return out / total


def np_dropped(idx, factor):
    """The share of assignments [N, k] past their expert's ceil(factor N k / E) slots,
    first choices before second ones and in token order within a choice."""
    capacity = max(1, math.ceil(factor * idx.size / E))
    seen, dropped = np.zeros(E, int), 0
    for choice in range(idx.shape[1]):
        for e in idx[:, choice]:
            dropped += seen[e] >= capacity
            seen[e] += 1
    return dropped / idx.size


def test_the_gradient_is_the_cross_entropys_plus_the_balancing_losses(rng):
    """With plain SGD at lr 1 the step moves each param by minus its gradient: that equals
    jax.grad of the reference train loss (layer 1 of 2 sparse, capacity-limited, two
    micro-batches); loss stays the cross entropy, and moe_aux, moe_z, moe_load (max / mean
    assignments) and moe_dropped are the routing's own numbers."""
    accum = 2
    aux_loss, z_loss, factor = 0.5, 0.05, 1.0
    mcfg, model, tx, schedule = moe_setup(
        "model.moe.layers=1", f"model.moe.aux_loss={aux_loss}", f"model.moe.z_loss={z_loss}",
        "model.moe.dispatch=capacity", f"model.moe.capacity_factor={factor}",
        tx=optax.apply_if_finite(optax.sgd(1.0), 10))
    batch = random_batch(rng, mcfg.vocab_size, 4, keep=0.8)
    state = init_state(model, tx, int(rng.integers(1 << 30)))
    params = jax.device_get(state.params)
    micro = [jax.tree.map(lambda x: jnp.asarray(x[i::accum]), batch) for i in range(accum)]
    want = jax.jit(jax.grad(lambda p: reference_train_loss(model, p, micro, aux_loss, z_loss))
                   )(params)
    new, m = make_train_step(model, tx, schedule, grad_accum=accum)(state, batch)
    got = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                       params, jax.device_get(new.params))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want)):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * np.abs(w).max() + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))

    routing = jax.jit(lambda p, x: router_cache(model, p, x))
    runs = [routing(params, mb["inputs"]) for mb in micro]  # capacity: per micro-batch
    routed, ids = [r[1] for r in runs], sorted(runs[0][1])
    nll = [np_nll(logits, mb["targets"]) * mb["loss_mask"]
           for (logits, _), mb in zip(runs, micro)]
    np.testing.assert_allclose(m["loss"], sum(x.sum() for x in nll) / batch["loss_mask"].sum(),
                               rtol=1e-5)
    counts = [float(mb["loss_mask"].sum()) for mb in micro]
    for key, fn in (("moe_aux", lambda rl, idx: E * np.sum(
            np.bincount(np.ravel(idx), minlength=E) / idx.size
            * np.mean(jax.nn.softmax(rl), 0))),
                    ("moe_z", lambda rl, idx: np.mean(jax.nn.logsumexp(rl, -1) ** 2))):
        per_mb = [np.mean([fn(*r[i]) for i in ids]) for r in routed]
        np.testing.assert_allclose(m[key], np.dot(per_mb, counts) / sum(counts), rtol=1e-5)
    for j, i in enumerate(ids):
        load = sum(np.bincount(np.ravel(r[i][1]), minlength=E) for r in routed)
        assert m["moe_load"][j] == pytest.approx(load.max() / load.mean(), rel=1e-6)
        dropped = np.mean([np_dropped(np.asarray(r[i][1]), factor) for r in routed])
        assert m["moe_dropped"][j] == pytest.approx(dropped, rel=1e-6, abs=1e-7)
        assert dropped > 0  # 128 assignments to 4 experts of 32 slots: unless all get 32


@pytest.mark.parametrize("scan", [False, True])
def test_the_penalty_is_the_mean_over_several_sparse_layers(rng, scan):
    """Three sparse layers of four (layers 0, 2, 3; scanned, as the runs [0], [1] dense,
    [2, 3]): the train loss per token (loss_sums) is the mean cross entropy plus aux_loss x
    the mean over the sparse layers of each one's switch loss E sum_e f_e p_e, plus z_loss x
    the mean of their z-losses (not the sums), each layer's from its own router logits and
    choices (the hooks) in float64."""
    from jaxformer.training.step import loss_sums
    aux_loss, z_loss = 0.5, 0.05
    mcfg, model, _, _ = moe_setup("model.n_layers=4", "model.moe.layers=[0,2,3]",
                                  f"model.moe.aux_loss={aux_loss}", f"model.moe.z_loss={z_loss}",
                                  f"model.scan_layers={str(scan).lower()}")
    assert model.cfg.sparse_layers == (True, False, True, True)
    params = jax.device_get(init_state(model, optax.sgd(1.0), int(rng.integers(1 << 30))).params)
    batch = jax.tree.map(jnp.asarray, random_batch(rng, mcfg.vocab_size, 2, keep=0.8))

    @jax.jit
    def ours(params):
        total, count = loss_sums(model, params, batch)
        return total / count, router_cache(model, params, batch["inputs"])

    loss, (logits, routers) = ours(params)
    mask = np.asarray(batch["loss_mask"], np.float64)
    nll = np.sum(np_nll(logits, batch["targets"]) * mask) / mask.sum()
    assert sorted(routers) == [0, 2, 3]
    aux, z = [], []
    for rl, idx in routers.values():
        rl, idx = np.asarray(rl, np.float64), np.asarray(idx)
        p = np.exp(rl - rl.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        f = np.bincount(idx.ravel(), minlength=E) / idx.size
        aux.append(E * np.sum(f * p.mean(0)))
        lse = np.log(np.exp(rl).sum(-1))
        z.append(np.mean(lse ** 2))
    want = nll + aux_loss * np.mean(aux) + z_loss * np.mean(z)
    assert float(loss) == pytest.approx(want, rel=1e-5)


def skewed_state(model, tx, rng, favourite=2.0):
    """A fresh state whose routers send most tokens to expert 0: router kernels of std
    1 / sqrt(d) (varied choices) and a router bias of `favourite` on expert 0."""
    state = jax.device_get(init_state(model, tx, int(rng.integers(1 << 30))))
    params = dict(state.params)
    for i in (0, 1):
        ffn = dict(params[f"block_{i}"]["ffn"])
        d = ffn["router"]["kernel"].shape[0]
        ffn["router"] = {"kernel": rng.normal(0, d ** -0.5, (d, E)).astype(np.float32),
                         "bias": np.array([favourite, 0, 0, 0], np.float32)}
        params[f"block_{i}"] = {**params[f"block_{i}"], "ffn": ffn}
    return jax.tree.map(jnp.asarray, state.replace(params=params))


@pytest.mark.parametrize("rate", [0.03, 0.0])
def test_bias_update_balances_a_skewed_router(rng, rate):
    """With a router that sends most tokens to one expert and a tiny learning rate, the bias
    update (bias_update_rate > 0) balances it within 30 steps (max / mean load falls);
    without it the imbalance stays. Each step's score_bias is old + rate sign(mean load -
    load) over the batch's assignments (counted from the hooks, summed over both
    micro-batches), bit for bit: what AdamW's decay of every param did to it is gone."""
    tx = optax.apply_if_finite(optax.adamw(1e-5, weight_decay=1.0), 10)  # decays score_bias
    mcfg, model, tx, schedule = moe_setup("model.moe.bias=true",
                                          f"model.moe.bias_update_rate={rate}", tx=tx)
    state = skewed_state(model, tx, rng)
    step = make_train_step(model, tx, schedule, grad_accum=2)
    routing = jax.jit(lambda p, x: router_cache(model, p, x)[1])
    imbalance = []
    for k in range(30):
        batch = random_batch(rng, mcfg.vocab_size, 8)
        before = jax.device_get(state.params)
        if k < 3 and rate:
            routers = routing(before, batch["inputs"])
        state, m = step(state, batch)
        imbalance.append(np.asarray(m["moe_load"]))
        if k < 3 and rate:
            for i, (_, idx) in routers.items():
                load = np.bincount(np.ravel(idx), minlength=E).astype(np.float32)
                old = before[f"block_{i}"]["ffn"]["score_bias"]
                want = old + np.float32(rate) * np.sign(load.mean() - load).astype(np.float32)
                np.testing.assert_array_equal(state.params[f"block_{i}"]["ffn"]["score_bias"],
                                              want)
    first, last = np.mean(imbalance[:3], axis=0), np.mean(imbalance[-10:], axis=0)
    assert np.all(first > 1.5), first  # most tokens' choices include expert 0 (2 is all)
    if rate:
        assert np.all(last < 0.8 * first), (first, last)
    else:
        assert np.all(last > 0.92 * first), (first, last)


def test_bias_update_resumes_bit_for_bit_and_eval_is_the_cross_entropy(corpus, tmp_path,
                                                                       monkeypatch):
    """6 steps straight equal 3 steps and 3 resumed from the orbax checkpoint of step 3 (a
    copy of the run with the later checkpoint removed): the same losses, params (score_bias
    included, moved) and optimizer state bit for bit. metrics.jsonl carries moe_aux, moe_z and
    moe_load/i, moe_dropped/i for every sparse layer; val_loss is the cross entropy alone
    (no aux_loss in it)."""
    monkeypatch.setattr(loop, "peak_flops", lambda dtype: (1e9, "a test's peak"))
    same = (*MOE, "model.scan_layers=true", "model.moe.bias_update_rate=0.01",
            "model.moe.aux_loss=0.5", "model.moe.z_loss=0.01", "train.steps=6",
            "checkpoint.every=3", "train.eval_every=100", "train.sample_tokens=0")
    cfg, summary, straight, resumed = resumed_like_straight(
        lambda d: config(corpus, d, *same), tmp_path, drop=("best",))
    a = same_saved_state(cfg, straight, resumed)  # optimizer state too
    assert np.any(np.asarray(a.params["blocks"]["ffn"]["score_bias"]) != 0)

    records = [r for r in read_metrics(straight) if "loss" in r]
    assert len(records) == 6
    for r in records:
        assert {"moe_aux", "moe_z", "moe_load/0", "moe_load/1", "moe_dropped/0",
                "moe_dropped/1"} <= set(r) and "moe_load/2" not in r
        assert 1 <= r["moe_load/0"] <= E / K and r["moe_dropped/1"] == 0  # dropless
    assert summary["val_loss"] == pytest.approx(hand_val_loss(cfg, straight, 6), rel=1e-5)


def test_a_sweep_of_a_moe_model_is_refused():
    _, model, tx, schedule = moe_setup("model.lora.rank=2", "model.lora.sweep_seeds=2")
    with pytest.raises(ConfigError, match="sweep .* mixture-of-experts"):
        make_train_step(model, tx, schedule)
