"""Hybrid models (recurrent mixers beside attention, jaxformer.model.mixers) against their
own full forward, for every recurrent row of MIXERS: causal, packed documents as apart,
a cache (prefill, padded prompts, one-token steps) as the full forward, scanned as
unscanned, bf16 near float32, sharded (8 fake CPU devices, one subprocess: this file run
as a module) as one device; and the configs refused in one line. A row whose module is
not built yet is skipped."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.attention.kv_cache import init_cache
from jaxformer.core.sharding import (batch_sharding, make_mesh, param_shardings,
                                     resolve_rules, traced_under)
from jaxformer.core.validation import ConfigError
from jaxformer.decode.cached_forward import prefill
from jaxformer.model.mixers import MIXERS
from jaxformer.model.transformer import stack_layers
from jaxformer.training.step import loss_sums
from tests.conftest import REPO

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
RECURRENT = [n for n, m in MIXERS.items() if m.recurrent]
# tiny settings; chunk 4 so that T = 13 spans three chunks and a partial one
SMALL = {"short_conv": {"kernel": 3},
         "gated_delta": {"heads": 2, "key_dim": 8, "value_dim": 8, "conv": 3, "chunk": 4},
         "mamba2": {"heads": 2, "head_dim": 8, "state": 8, "conv": 3, "chunk": 4}}
T = 13


def hybrid(name: str, **kw) -> ModelConfig:
    """Four layers of pattern [name, name, attention] (a recurrent layer last too)."""
    return ModelConfig(**{**dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=64,
        max_seq_len=32, norm="rmsnorm", ffn="swiglu", layer_pattern=["r", "r", "a"],
        layer_kinds={"r": {"mixer": name}, "a": {}}, mixer={name: SMALL.get(name, {})}),
        **kw})


@functools.lru_cache(maxsize=None)
def _initial(cfg: ModelConfig):
    """The model's init (one per config and process: what the tests draw varies it)."""
    return jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


@functools.lru_cache(maxsize=None)
def built_yet(mixer: str) -> bool:
    """Whether the mixer's module is built (a module being written raises
    NotImplementedError when traced)."""
    try:
        jax.eval_shape(Transformer(hybrid(mixer)).init, jax.random.key(0),
                       jnp.zeros((1, 4), jnp.int32))
        return True
    except NotImplementedError:
        return False


def random_params(cfg: ModelConfig, draw: np.random.Generator):
    """The model's init with its matrices (convolutions too) moved by N(0, 0.1) drawn
    afresh: outputs that depend on their inputs well beyond rounding."""
    params = _initial(cfg)["params"]
    return jax.tree.map(lambda x: x + 0.1 * draw.standard_normal(x.shape, np.float32)
                        if x.ndim >= 2 else x, params)


def built(mixer: str, **kw):
    """(config, model, random params) of the hybrid of `mixer`; skipped if it is not built."""
    if not built_yet(mixer):
        pytest.skip(f"model.mixer.{mixer}'s module is not built yet (NotImplementedError)")
    cfg = hybrid(mixer, **kw)
    return cfg, Transformer(cfg), random_params(cfg, rng)


@functools.lru_cache(maxsize=None)
def _forward(cfg: ModelConfig):
    return jax.jit(Transformer(cfg).apply)


def logits_of(cfg, params, tokens, positions=None, segment_ids=None):
    """float64 logits [3, T, V] of tokens [3, T] (one shape: one compiled forward per
    config), with positions and segment ids (default arange, one segment)."""
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
    segment_ids = np.ones((b, t)) if segment_ids is None else segment_ids
    return np.asarray(_forward(cfg)({"params": params}, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(positions, jnp.int32),
                                    jnp.asarray(segment_ids, jnp.int32)), np.float64)


def tokens_of(b: int, t: int, vocab: int = 64):
    return rng.integers(0, vocab, (b, t)).astype(np.int32)


def assert_close(got, want, rel=2e-5, what=""):
    """Within rel of want's largest magnitude, everywhere."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * float(np.abs(want).max()),
                               err_msg=what)


@pytest.mark.parametrize("mixer", RECURRENT)
def test_changing_a_token_changes_no_earlier_logit(mixer):
    """Row 1 is row 0 with token j changed: their logits before j are equal, each from j
    on differs."""
    cfg, _, params = built(mixer)
    tokens = tokens_of(3, T)
    j = int(rng.integers(1, T))
    tokens[1] = tokens[0]
    tokens[1, j] = (tokens[0, j] + rng.integers(1, 64)) % 64
    logits = logits_of(cfg, params, tokens)
    np.testing.assert_array_equal(logits[1, :j], logits[0, :j])
    assert (np.abs(logits[1, j:] - logits[0, j:]).max(-1) > 1e-4).all()


@pytest.mark.parametrize("mixer", RECURRENT)
def test_packed_documents_read_as_each_alone(mixer):
    """Two documents packed in each row (segment ids 1, 2, positions from 0 each; the
    rows split differently) and a trailing padding run (id 0): each document's logits are
    those of a row holding it alone (random tokens after it: causal, unread)."""
    cfg, _, params = built(mixer)
    firsts = rng.integers(3, T - 4, 3)
    packed, seg, pos = tokens_of(3, T), np.zeros((3, T), int), np.zeros((3, T), int)
    for r, first in enumerate(firsts):
        second = int(rng.integers(2, T - first - 1))
        seg[r] = np.repeat([1, 2, 0], [first, second, T - first - second])
        pos[r, :first + second] = np.concatenate([np.arange(first), np.arange(second)])
    got = logits_of(cfg, params, packed, pos, seg)
    assert np.isfinite(got).all()
    for doc in (1, 2):
        alone = tokens_of(3, T)
        starts = np.argmax(seg == doc, 1)
        ends = starts + (seg == doc).sum(1)
        for r in range(3):
            alone[r, :ends[r] - starts[r]] = packed[r, starts[r]:ends[r]]
        want = logits_of(cfg, params, alone)
        for r in range(3):
            assert_close(got[r, starts[r]:ends[r]], want[r, :ends[r] - starts[r]],
                         what=f"row {r} document {doc}")


@functools.lru_cache(maxsize=None)
def _cached_run(cfg: ModelConfig, w: int, n: int):
    """jit(params, tokens [3, w + n], lengths [3] -> (a plain prefill of tokens[:, :w]
    then n one-token steps: logits [3, w + n, V]; jaxformer.decode's prefill of prompts
    tokens[:, :w] right-padded at lengths, then n - 1 steps: logits [3, n, V]))."""
    model = Transformer(cfg)

    def steps(apply, cache, toks, pos):  # toks, pos [3, m] -> logits [3, m, V]
        def step(cache, xs):
            out, cache = apply(xs[0][:, None], xs[1][:, None], cache=cache)
            return cache, out[:, 0]
        return jax.lax.scan(step, cache, (toks.T, pos.T))[1].transpose(1, 0, 2)

    @jax.jit
    def run(params, tokens, lengths):
        apply = functools.partial(model.apply, {"params": params})
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        logits, cache = apply(tokens[:, :w], pos[:, :w], cache=init_cache(cfg, b, t))
        plain = jnp.concatenate([logits, steps(apply, cache, tokens[:, w:], pos[:, w:])], 1)
        last, cache = prefill(model, params, tokens[:, :w], lengths, t, None, True)
        cont = tokens[:, w:t - 1]  # row r's token i sits at position lengths[r] + i
        padded = steps(apply, cache, cont, lengths[:, None] + jnp.arange(n - 1))
        return plain, jnp.concatenate([last[:, None], padded], 1)
    return run


@pytest.mark.parametrize("mixer", RECURRENT)
def test_prefill_then_steps_equal_the_full_forward(mixer):
    """A cache filled by a prefill of 9 tokens (two chunks and a partial one), then 4
    one-token steps: the full forward's logits. jaxformer.decode's prefill of those 9
    right-padded at three lengths (the padding random tokens) then steps at each row's own
    positions: the full forward's over each row's real tokens."""
    cfg, _, params = built(mixer)
    w, n = 9, T - 9
    tokens = tokens_of(3, T)
    lengths = np.array([w, *rng.integers(1, w, 2)], np.int32)
    plain, padded = _cached_run(cfg, w, n)(params, jnp.asarray(tokens), jnp.asarray(lengths))
    assert_close(np.asarray(plain), logits_of(cfg, params, tokens), what="plain prefill")
    real = tokens_of(3, T)  # each row's real tokens, then random ones (unread)
    for r in range(3):
        real[r, :lengths[r] + n] = np.concatenate([tokens[r, :lengths[r]], tokens[r, w:]])
    full = logits_of(cfg, params, real)
    want = np.stack([full[r, lengths[r] - 1 + np.arange(n)] for r in range(3)])
    assert_close(np.asarray(padded), want, what="padded prefill")


@pytest.mark.parametrize("mixer", RECURRENT)
def test_scanned_rematerialised_layers_equal_unscanned(mixer):
    """scan_layers with remat=full over stacked params (runs [r r] [a] [r]): the loss and
    its gradient on a packed, padded batch are the unscanned model's."""
    cfg, model, params = built(mixer)
    scanned = Transformer(cfg.replace(scan_layers=True, remat="full"))
    tokens = tokens_of(2, T + 1)
    seg = np.repeat(np.array([1, 2, 0]), [6, T - 8, 2])[None].repeat(2, 0)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg,
                 loss_mask=(seg > 0).astype(np.float32))

    def loss_and_grad(m, p):
        return jax.jit(jax.value_and_grad(lambda p: loss_sums(m, p, batch)[0]))(p)

    want, grads = loss_and_grad(model, params)
    got, stacked = loss_and_grad(scanned, stack_layers(params, cfg.n_layers))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    want_leaves = jax.tree.leaves_with_path(stack_layers(grads, cfg.n_layers))
    got_leaves = jax.tree.leaves_with_path(stacked)
    assert [k for k, _ in got_leaves] == [k for k, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        # a head's decay (A_log, dt_bias) sums its gradient over every position, and the
        # two programs round those sums apart: within 2.8e-5 of the leaf's largest value
        # over 12 draws of gated_delta, and 1.6e-4 in one (JAXFORMER_TEST_SEED=2429655922),
        # where the head's terms cancelled; a wrong layer or segment is O(1) either way
        decay = jax.tree_util.keystr(path).endswith(("['A_log']", "['dt_bias']"))
        assert_close(np.asarray(g), np.asarray(w), rel=1e-3 if decay else 1e-4,
                     what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mixer", RECURRENT)
def test_bfloat16_compute_stays_near_float32(mixer):
    """Computed in bfloat16 (params float32): the logits stay near float32's (mean error
    within 5% of their spread; rounding alone reaches ~2.5% for gated_delta)."""
    cfg, _, params = built(mixer)
    tokens = tokens_of(3, T)
    want = logits_of(cfg, params, tokens)
    error = np.abs(logits_of(cfg.replace(dtype="bfloat16"), params, tokens) - want)
    assert error.mean() < 0.05 * want.std() and error.max() < want.std()


# ---- sharded (8 fake CPU devices, in one subprocess) ----------------------------------

MESHES = {"data 2, tensor 4": (2, 1, 4), "fsdp 2, tensor 2, data 2": (2, 2, 2)}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """This file run as a module with 8 fake CPU devices (_sharded_worker)."""
    out = tmp_path_factory.mktemp("mixers") / "sharded.json"
    seed = int(rng.integers(1 << 30))
    print(f"sharded worker: SEED={seed}")  # shown if a test using it fails
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, SEED=str(seed), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "tests.model.test_mixers", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_sharded_loss_and_gradients_equal_one_devices(sharded_runs):
    """A hybrid of every built recurrent mixer and attention: its loss and gradient
    on a packed, padded batch under (data 2, tensor 4) and (fsdp 2, tensor 2, data 2) equal
    one device's."""
    run = sharded_runs["loss"]
    if not run["mixers"]:
        pytest.skip(f"no recurrent mixer is built: {run['skipped']}")
    for mesh in MESHES:
        assert run[mesh]["loss"] == pytest.approx(run["one"]["loss"], rel=1e-5), mesh
        assert run[mesh]["grad_diff"] < 1e-5 * run["one"]["grad_max"], mesh


def test_a_context_split_with_recurrent_layers_is_refused(sharded_runs):
    message = sharded_runs["context"]
    assert "\n" not in message and "recurrent layers" in message, message
    assert "mesh.context=1" in message


def _every_mixer(**kw) -> ModelConfig | None:
    """A hybrid of every recurrent mixer that is built, then attention; None if none is."""
    names = [n for n in RECURRENT if built_yet(n)]
    if not names:
        return None
    return hybrid(names[0], n_layers=len(names) + 1, layer_pattern=[*names, "a"],
                  layer_kinds={**{n: {"mixer": n} for n in names}, "a": {}},
                  mixer={n: SMALL.get(n, {}) for n in names}, **kw)


def _sharded_worker(out: str):
    """Run as `python -m tests.model.test_mixers OUT` with 8 devices: the loss and
    gradient sums of _every_mixer's model on one device and on MESHES, and the refusal of
    a split over mesh.context."""
    rules = resolve_rules()
    draw = np.random.default_rng(int(os.environ.get("SEED", "0")))
    tokens = draw.integers(0, 64, (4, 17)).astype(np.int32)
    seg = np.repeat(np.array([1, 2, 0]), [7, 6, 3])[None].repeat(4, 0)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg,
                 loss_mask=(seg > 0).astype(np.float32))
    cfg = _every_mixer()
    run = {"mixers": cfg and sorted(set(cfg.layer_mixers) - {"attention"}),
           "skipped": [n for n in RECURRENT if not cfg or n not in cfg.layer_mixers]}
    if cfg:
        model = Transformer(cfg)
        params = random_params(cfg, draw)
        grad = jax.value_and_grad(lambda p, b: loss_sums(model, p, b)[0])
        loss, g = jax.jit(grad)(params, batch)
        ref = jax.tree.leaves(g)
        run["one"] = {"loss": float(loss), "grad_max": max(float(jnp.abs(x).max())
                                                           for x in ref)}
        for name, shape in MESHES.items():
            mesh = make_mesh(*shape)
            p = jax.device_put(params, param_shardings(model, mesh, rules))
            b = jax.device_put(batch, batch_sharding(mesh, rules))
            loss, g = jax.jit(traced_under(mesh, rules, grad))(p, b)
            run[name] = {"loss": float(loss), "grad_diff": max(
                float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(g), ref))}
    cfg = hybrid("short_conv")
    model = Transformer(cfg)
    try:
        jax.eval_shape(traced_under(make_mesh(2, 1, 1, 4), rules, lambda p, b: loss_sums(
            model, p, b)), jax.eval_shape(lambda: _initial(cfg)["params"]), batch)
        context = "(nothing refused)"
    except (ValueError, ConfigError) as e:
        context = str(e)
    with open(out, "w") as f:
        json.dump({"loss": run, "context": context}, f)


# ---- refused in one line --------------------------------------------------------------

def refused(match: str, **kw):
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=3, n_heads=2), **kw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mixer", RECURRENT)
def test_what_a_hybrid_cannot_be_is_refused_in_one_line(mixer):
    other = next(n for n in RECURRENT if n != mixer)
    pattern = dict(layer_pattern=["r", "a"], mixer={mixer: {}})
    for own in ({"window": 4}, {"rope_theta": 500.0}):
        refused(f"layer_kinds.r sets {next(iter(own))}",
                layer_kinds={"r": {"mixer": mixer, **own}, "a": {}}, **pattern)
    refused(f"position='alibi'.*{mixer}", position="alibi", layer_pattern=["r"],
            layer_kinds={"r": {"mixer": mixer}})
    refused(f"model.mixer.{other} is set but no layer", layer_kinds={"r": {"mixer": mixer},
            "a": {}}, layer_pattern=["r", "a"], mixer={other: {}})
    refused("unknown key model.mixer.lstm", mixer={"lstm": {}})
    refused(f"arch=encoder with recurrent layers.*{mixer}", arch="encoder",
            layer_kinds={"r": {"mixer": mixer}, "a": {}}, **pattern)


if __name__ == "__main__":
    _sharded_worker(sys.argv[1])
