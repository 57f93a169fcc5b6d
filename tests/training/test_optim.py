"""The optimizer and schedule tables (jaxformer.training.optim): each optimizer's settings
are its own (keys of the optim section, refused under another optimizer in one line), a
run's config.yaml written before the tables loads and resumes bit for bit, and AdamW and
Muon build the same optax chains as before."""

import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from jaxformer import ModelConfig
from jaxformer.core.validation import ConfigError
from jaxformer.training import load_config
from jaxformer.training.config import RunConfig
from jaxformer.training.optim import (OPTIMIZERS, SCHEDULES, OptimConfig, decay_mask,
                                      learning_rate_schedule, make_optimizer, setting_keys)
from tests.training.test_loop import config, corpus, losses, restored_state  # noqa: F401

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

# A run's optim section as config.yaml held it before the tables (every field of the flat
# OptimConfig, Muon's too under adamw), with tests/training/test_loop.py's TINY values.
OLD_DUMP = {"name": "adamw", "lr": 0.003, "schedule": "cosine", "warmup_steps": 2,
            "min_lr_ratio": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1.0e-08, "weight_decay": 0.1,
            "clip_norm": 1.0, "grad_accum": 1, "max_skips": 5, "muon_beta": 0.95,
            "muon_rms": 0.2, "label_smoothing": 0.0}


def test_an_old_full_dump_loads_with_its_settings():
    """The old dump under adamw (Muon's keys at their defaults) and under muon (its own
    values), drawn afresh, load through the run config's loader into each optimizer's
    settings."""
    b1, b2, wd, beta, rms = (float(rng.uniform(0.5, 0.99)) for _ in range(5))
    old = {**OLD_DUMP, "b1": b1, "b2": b2, "weight_decay": wd}
    cfg = RunConfig.from_dict({"optim": old}).optim
    assert cfg.settings == OPTIMIZERS["adamw"].settings(b1=b1, b2=b2, eps=1e-8, weight_decay=wd)
    assert (cfg.b1, cfg.b2, cfg.weight_decay, cfg.muon_beta, cfg.muon_rms) == (b1, b2, wd, None,
                                                                                None)
    cfg = RunConfig.from_dict({"optim": {**old, "name": "muon", "muon_beta": beta,
                                         "muon_rms": rms}}).optim
    assert cfg.settings == OPTIMIZERS["muon"].settings(b1=b1, b2=b2, eps=1e-8, weight_decay=wd,
                                                       muon_beta=beta, muon_rms=rms)


def test_an_old_run_resumes_bitwise(corpus, tmp_path):  # noqa: F811
    """A run whose config.yaml holds the old flat optim section (written out literally
    above) resumes from its step-2 checkpoint with the uninterrupted run's losses and
    optimizer state, bit for bit."""
    from jaxformer.training import train
    same = ("train.steps=4", "checkpoint.every=2", "train.eval_every=100",
            "train.sample_tokens=0")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cfg = config(corpus, straight, *same)
    train(cfg, log=lambda *a: None)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints/4")
    (resumed / "metrics.jsonl").unlink()
    saved = yaml.safe_load((resumed / "config.yaml").read_text())
    saved["optim"] = OLD_DUMP
    (resumed / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    old = load_config(str(resumed / "config.yaml"), [f"train.run_dir={resumed}"])
    assert old.optim == cfg.optim
    assert train(old, log=lambda *a: None)["start_step"] == 2
    a, b = losses(straight), losses(resumed)
    assert set(b) == {3, 4} and all(a[k] == b[k] for k in b), (a, b)
    x, y = restored_state(cfg, straight), restored_state(old, resumed)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, x, y)))


def test_another_optimizers_setting_is_refused_in_one_line():
    """optim.muon_beta under adamw (a value other than Muon's default) fails in one line
    naming its optimizer; under muon it is Muon's momentum, typed from the command line."""
    beta = float(rng.uniform(0.5, 0.9))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"optim.muon_beta={beta}"])
    msg = str(err.value)
    assert f"optim.muon_beta={beta}" in msg and "optim.name=muon" in msg and "\n" not in msg
    cfg = load_config(None, ["optim.name=muon", f"optim.muon_beta={beta}"]).optim
    assert cfg.settings.muon_beta == beta and cfg.muon_beta == beta
    with pytest.raises(ConfigError, match=r"^optim.b2=1.5 must be < 1$"):
        OptimConfig(name="muon", b2=1.5)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_owns_its_settings(name):
    """Every setting of every entry is a key of the optim section; a config of the entry
    holds its settings' defaults and no other optimizer's, and its dump (config.yaml)
    loads back to the same config, with values drawn afresh."""
    entry = OPTIMIZERS[name]
    assert set(entry.keys()) <= set(OptimConfig.__dataclass_fields__)
    cfg = OptimConfig(name=name)
    assert cfg.settings == entry.settings()
    assert all(getattr(cfg, k) is None for k in setting_keys() if k not in entry.keys())
    drawn = {k: float(rng.uniform(0.01, 0.5)) for k in entry.keys()}
    cfg = OptimConfig(name=name, **drawn)
    assert cfg.settings == entry.settings(**drawn)
    assert RunConfig.from_dict({"optim": dataclasses.asdict(cfg)}).optim == cfg
    tx, _ = make_optimizer(cfg, ModelConfig(), 10)
    params = {"w": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}}
    updates, _ = tx.update(params, tx.init(params), params)
    assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_warms_up_to_its_peak(schedule):
    """Every schedule rises over warmup_steps (drawn) to about lr at their end (inverse_sqrt's
    peak is lr / sqrt(d_model * warmup_steps)), and falls or stays after."""
    warmup, lr, d = int(rng.integers(2, 20)), float(rng.uniform(1e-4, 1e-2)), 64
    cfg = OptimConfig(schedule=schedule, lr=lr, warmup_steps=warmup)
    sched = learning_rate_schedule(cfg, ModelConfig(d_model=d, n_heads=4), 10 * warmup)
    values = np.array([float(sched(s)) for s in range(10 * warmup)])
    peak = values[warmup - 1: warmup + 1].max()
    assert np.all(np.diff(values[:warmup]) > 0) and np.all(np.diff(values[warmup:]) <= 1e-12)
    assert peak == pytest.approx(values.max())


def test_inverse_sqrt_needs_warmup_in_one_line():
    with pytest.raises(ConfigError, match="^optim.warmup_steps must be >= 1 for "
                                          "schedule=inverse_sqrt$"):
        OptimConfig(schedule="inverse_sqrt", warmup_steps=0)


def test_adamw_is_the_same_optax_chain():
    """make_optimizer's AdamW is optax's chain written out by hand (clipping, adamw with
    the decay mask, apply_if_finite), bit for bit over three steps of random gradients."""
    params = {"block_0": {"ffn": {"wi": {"kernel": rng.normal(size=(8, 16)),
                                         "bias": rng.normal(size=(16,))}}},
              "final_norm": {"scale": rng.normal(size=(8,))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    b1, b2, wd, clip = (float(rng.uniform(0.5, 0.99)) for _ in range(4))
    cfg = OptimConfig(lr=0.01, warmup_steps=3, b1=b1, b2=b2, weight_decay=wd, clip_norm=clip)
    ours, sched = make_optimizer(cfg, ModelConfig(), 20)
    theirs = optax.apply_if_finite(optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(sched, b1=b1, b2=b2, eps=1e-8, weight_decay=wd, mask=decay_mask)),
        max_consecutive_errors=2**30)
    a, b = ours.init(params), theirs.init(params)
    for _ in range(3):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        (ua, a), (ub, b) = ours.update(g, a, params), theirs.update(g, b, params)
        jax.tree.map(np.testing.assert_array_equal, ua, ub)


def np_lion(w, grads, lr, b1, b2, wd, decayed):
    """The param after len(grads) Lion steps (Chen et al. 2023, Algorithm 2), in float64:
    u = sign(b1 m + (1 - b1) g), m <- b2 m + (1 - b2) g, w <- w - lr (u + wd w)."""
    w, m = np.float64(w), 0.0
    for g in grads:
        g = np.float64(g)
        u = np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
        w = w - lr * (u + wd * w * decayed)
    return w


def test_lion_steps_match_the_paper_and_optax():
    """optim.name=lion: three steps on random params and gradients, with settings drawn
    afresh, equal optax.lion applied by hand (with the decay mask) and Lion's float64
    formula (decay on kernels only), to float32 rounding."""
    params = {"block_0": {"attn": {"query": {"kernel": rng.normal(size=(8, 2, 4))}},
                          "ffn": {"wi": {"kernel": rng.normal(size=(8, 16)),
                                         "bias": rng.normal(size=(16,))}}},
              "embed": {"embedding": rng.normal(size=(11, 8))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    lr, b1, b2, wd = (float(rng.uniform(0.05, 0.95)) for _ in range(4))
    cfg = OptimConfig(name="lion", lr=lr, b1=b1, b2=b2, weight_decay=wd, schedule="constant",
                      warmup_steps=0, clip_norm=None)
    ours, sched = make_optimizer(cfg, ModelConfig(), 10)
    theirs = optax.lion(sched, b1=b1, b2=b2, weight_decay=wd, mask=decay_mask)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
             for _ in range(3)]
    a, b, new, by_hand = ours.init(params), theirs.init(params), params, params
    for g in grads:
        (ua, a), (ub, b) = ours.update(g, a, new), theirs.update(g, b, by_hand)
        new, by_hand = optax.apply_updates(new, ua), optax.apply_updates(by_hand, ub)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), new,
                 by_hand)  # ours runs inside apply_if_finite's cond: compiled, fused
    for path, leaf in jax.tree_util.tree_leaves_with_path(new):
        pick = lambda tree: np.asarray(functools.reduce(lambda t, k: t[k.key], path, tree))  # noqa: E731
        want = np_lion(pick(params), [pick(g) for g in grads], lr, b1, b2, wd,
                       decayed=path[-1].key == "kernel")
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_lion_trains(corpus, tmp_path):  # noqa: F811
    """configs/tiny.yaml with optim.name=lion (a tenth of AdamW's lr, ten times its
    weight decay): the loss falls in six steps."""
    from jaxformer.training import train
    run = tmp_path / "lion"
    train(config(corpus, run, "optim.name=lion", "optim.lr=3e-4", "optim.weight_decay=1.0",
                 "train.steps=6", "train.eval_every=100", "train.sample_tokens=0"),
          log=lambda *a: None)
    a = losses(run)
    assert a[6] < a[1], a
