"""Sharding: meshes, logical axis rules, and training on 8 fake CPU devices (in
subprocesses, tests/core/mesh_worker.py) and on two processes through train.py."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.sharding import (DEFAULT_RULES, MESH_AXES, batch_sharding, cluster_detected,
                                     logical_axes, make_mesh, mesh_shape, process_rows,
                                     resolve_rules)
from jaxformer.model.config import ConfigError
from jaxformer.positions.schemes import POSITION_SCHEMES
from jaxformer.training import load_config
from jaxformer.training.metrics import read_metrics
from tests.conftest import REPO, xla_flags

pytestmark = pytest.mark.heavy  # run first: tests/conftest.py

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


# every task of tests/core/mesh_worker.py these tests read, run in one subprocess
WORKER_TASKS = ["losses", "checkpoint", "decode", "splash", "patterns", "context", "study_eval"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """{task: its findings} of WORKER_TASKS, one after another in one process with 8 fake
    CPU devices (one JAX start; checkpoint reuses the (2, 2, 2) step losses compiled)."""
    out = tmp_path_factory.mktemp("mesh") / "mesh.json"
    seed = int(rng.integers(1 << 30))
    print(f"mesh worker: SEED={seed}")  # shown if a test using it fails
    env = dict(os.environ, PYTHONPATH=str(REPO), SEED=str(seed))
    proc = subprocess.run([sys.executable, "-m", "tests.core.mesh_worker", ",".join(WORKER_TASKS),
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def findings(worker, task):
    """What the worker's task found; the test fails with its traceback if it raised."""
    assert "error" not in worker[task], worker[task]["error"]
    return worker[task]


# ---- in process ----------------------------------------------------------------------

def test_mesh_shape_fills_one_axis_and_rejects_wrong_products():
    assert mesh_shape(-1, 2, 2, 8) == (2, 2, 2, 1, 1)
    assert mesh_shape(1, -1, 1, 8) == (1, 8, 1, 1, 1)
    assert mesh_shape(2, 1, 1, 8, context=-1) == (2, 1, 1, 4, 1)
    with pytest.raises(ConfigError, match="4 devices, but there are 8"):
        mesh_shape(2, 2, 1, 8)
    with pytest.raises(ConfigError, match="not divisible by 3"):
        mesh_shape(-1, 3, 1, 8)
    with pytest.raises(ConfigError, match="at most one"):
        mesh_shape(-1, -1, 1, 8)
    mesh = make_mesh(-1, 1, 1)
    assert mesh.axis_names == MESH_AXES and mesh.devices.size == jax.device_count()


def test_rules_overrides_and_their_errors():
    rules = dict(resolve_rules({"embed": None, "mlp": ["tensor", "fsdp"], "vocab": "null",
                                "heads": "data,tensor"}))
    assert rules["embed"] is None and rules["vocab"] is None
    assert rules["mlp"] == ("tensor", "fsdp") and rules["heads"] == ("data", "tensor")
    assert rules["kv_heads"] == DEFAULT_RULES["kv_heads"]
    with pytest.raises(ConfigError, match="unknown logical axis.*embed"):
        resolve_rules({"embd": "fsdp"})
    with pytest.raises(ConfigError, match="mesh axes are data, fsdp, tensor"):
        resolve_rules({"embed": "model"})
    with pytest.raises(ConfigError, match="mesh.rules.embd"):
        load_config(None, ["mesh.rules.embd=fsdp"])
    cfg = load_config(None, ["mesh.rules.embed=null", "mesh.fsdp=-1", "mesh.data=1"])
    assert dict(resolve_rules(cfg.mesh.rules))["embed"] is None
    mesh = load_config(None, ["mesh.fsdp=-1"]).mesh  # data: the rest, here 1
    assert (mesh.data, mesh.fsdp, mesh.tensor) == (1, -1, 1)
    assert load_config(None, []).mesh.data == -1  # default: data parallel over all devices
    with pytest.raises(ConfigError, match="at most one"):
        load_config(None, ["mesh.fsdp=-1", "mesh.tensor=-1"])
    with pytest.raises(ConfigError, match="host:port"):
        load_config(None, ["distributed.coordinator_address=localhost"])
    with pytest.raises(ConfigError, match="process_id=2 must be < distributed.num_processes=2"):
        load_config(None, ["distributed.num_processes=2", "distributed.process_id=2"])


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("kw", [*(dict(position=p) for p in POSITION_SCHEMES),  # the table
                                dict(ffn="swiglu", norm="rmsnorm", tie_embeddings=False,
                                     n_kv_heads=1, qkv_bias=True, use_bias=False),
                                dict(norm="rmsnorm_offset", block="sandwich",
                                     qk_norm="projection", layer_pattern="local,global",
                                     layer_kinds={"local": {"window": 2}, "global": {}}),
                                dict(block="parallel", qk_norm="head")])
def test_every_param_has_one_logical_name_per_dim(scan, kw):
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, max_seq_len=8,
                      scan_layers=scan, **kw)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))  # init gives arrays
    specs = logical_axes(model)
    flat = jax.tree_util.tree_leaves_with_path(params)
    spec_of = dict(jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    for path, x in flat:
        names = tuple(spec_of[path])
        assert len(names) == x.ndim and all(n in DEFAULT_RULES for n in names), (path, names)
        assert (names[:1] == ("layers",)) == (scan and "blocks" in jax.tree_util.keystr(path))


def test_zigzag_gives_every_device_equal_causal_work():
    """Device d holds chunks d and 2n - 1 - d of 2n: by hand for 8 positions on 2 devices;
    for any n every device's queries see the same number of keys (sum of position + 1);
    a length 2n does not divide is refused naming both."""
    from jaxformer.attention.ring import zigzag_order
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for n in (1, 2, 3, 4, 8):
        order = zigzag_order(16 * n, n)
        assert sorted(order.tolist()) == list(range(16 * n))
        work = (order + 1).reshape(n, -1).sum(1)
        assert (work == work[0]).all(), (n, work)
    with pytest.raises(ValueError, match="2 \\* 4 = 8, got 12"):
        zigzag_order(12, 4)


def _np_zigzag(t, n):
    """The zigzag order by its definition: of 2n chunks, chunk k goes to device
    min(k, 2n - 1 - k); devices one after another, each its positions in order."""
    c = t // (2 * n)
    return np.array(sorted(range(t), key=lambda p: (min(p // c, 2 * n - 1 - p // c), p)))


def test_zigzag_batch_permutes_every_array_alike():
    """zigzag_batch against the NumPy definition of the order, for 1 to 4 devices: every
    [B, T] array of a batch (tokens, targets, mask, segment ids, positions) reordered by it;
    without positions, the natural ones (0..T-1) reordered with the tokens; None kept."""
    from jaxformer.attention.ring import zigzag_batch
    for n in (1, 2, 3, 4):
        t = 2 * n * int(rng.integers(1, 4))
        batch = {k: rng.integers(0, 1000, (2, t)).astype(np.int32)
                 for k in ("inputs", "targets", "segment_ids", "positions")}
        batch["loss_mask"] = rng.random((2, t)).astype(np.float32)
        order = _np_zigzag(t, n)
        got = zigzag_batch(batch, n)
        assert set(got) == set(batch)
        for k, x in batch.items():
            np.testing.assert_array_equal(got[k], x[:, order], err_msg=f"{n} {k}")
        got = zigzag_batch(dict(batch, positions=None, segment_ids=None), n)
        np.testing.assert_array_equal(got["positions"], np.broadcast_to(order, (2, t)))
        np.testing.assert_array_equal(got["inputs"], batch["inputs"][:, order])
        assert got["segment_ids"] is None


def test_loss_sums_puts_a_split_sequence_in_the_meshs_zigzag_order(monkeypatch):
    """loss_sums with the sequence split over n devices (a stand-in split of n = 2, 4; a
    stand-in model recording what it is given) hands the model the batch in the zigzag
    order of n (the NumPy definition), positions with it; without a split, as given.
    (Any order gives the same loss: this is what keeps the ring's causal work balanced.)"""
    import types

    from jaxformer.training import step

    seen = {}

    class Model:
        cfg = ModelConfig()  # dense: loss_sums reads no MoE statistics

        def apply(self, variables, inputs, positions=None, segment_ids=None, **kw):
            seen.update(inputs=np.asarray(inputs), positions=positions)
            return jnp.zeros(inputs.shape + (8,))

    t = 16
    batch = dict(inputs=rng.integers(0, 8, (2, t)).astype(np.int32),
                 targets=rng.integers(0, 8, (2, t)).astype(np.int32),
                 loss_mask=np.ones((2, t), np.float32))
    for n in (2, 4):
        mesh = types.SimpleNamespace(shape={"data": 3, "context": n})
        monkeypatch.setattr(step, "sequence_split", lambda: (mesh, "context", ("data",), ()))
        step.loss_sums(Model(), {}, batch)
        order = _np_zigzag(t, n)
        np.testing.assert_array_equal(seen["inputs"], batch["inputs"][:, order], err_msg=n)
        np.testing.assert_array_equal(seen["positions"], np.broadcast_to(order, (2, t)))
    monkeypatch.setattr(step, "sequence_split", lambda: None)
    step.loss_sums(Model(), {}, batch)
    np.testing.assert_array_equal(seen["inputs"], batch["inputs"])
    assert seen["positions"] is None


def test_context_settings_and_their_errors():
    """mesh.context reads from a config and fills the devices with -1; a train.seq_len the
    zigzag cannot split names both numbers; auto picks the all-gather while one layer's K/V
    fit GATHERED_KV_BYTES, then the ring, and only with a split sequence."""
    from jaxformer.attention import backends
    from jaxformer.core.sharding import check_context_split
    cfg = load_config(None, ["mesh.context=4", "mesh.data=2"])
    assert (cfg.mesh.data, cfg.mesh.context) == (2, 4)
    assert load_config(None, ["mesh.context=-1"]).mesh.data == 1
    with pytest.raises(ConfigError, match="at most one"):
        load_config(None, ["mesh.context=-1", "mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match="train.seq_len=100 must be a multiple of 2 x "
                                          "mesh.context = 16"):
        check_context_split(100, 8)
    check_context_split(100, 1)
    big = backends.GATHERED_KV_BYTES + 1
    pick = lambda context, kv: backends.resolve_impl(  # noqa: E731
        "auto", jnp.float32, 64, position="alibi", context=context, kv_bytes=kv)
    assert (pick(4, 1 << 20), pick(4, big), pick(1, big)) == ("all_gather", "ring", "chunked")


def test_process_rows_on_one_process_is_the_whole_batch():
    sh = batch_sharding(make_mesh(), resolve_rules())
    assert process_rows(sh, 8) == slice(0, 8)


def test_cluster_detection(monkeypatch):
    for k in ("SLURM_NTASKS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert not cluster_detected()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert not cluster_detected()  # one task: nothing to initialize
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert cluster_detected()
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1")
    assert cluster_detected()


# ---- 8 fake devices --------------------------------------------------------------------

MESHES = ["(8, 1, 1)", "(1, 8, 1)", "(2, 1, 4)", "(2, 2, 2)", "(2, 1, 1, 4)"]


@pytest.fixture
def mesh_runs(worker):
    return findings(worker, "losses")


@pytest.mark.parametrize("task", ["splash", "patterns"])
def test_runs_on_every_mesh_like_one_device(task, worker):
    """On 8 devices, rows and heads split: logits and gradients of a packed, padded batch
    equal the reference backend's on one device. splash (interpret mode) runs under
    shard_map; patterns: a Gemma 3-like layer pattern, QK-norm over the split heads,
    soft-caps, blockwise with remat (tests/core/mesh_worker.py)."""
    res = findings(worker, task)
    assert set(res) == {"(2, 1, 4)", "(2, 2, 2)", "(8, 1, 1)"}
    for shape, r in res.items():
        assert r["shard_map"] == (task == "splash"), shape
        assert r["logits_diff"] < 1e-5, (shape, r)
        assert r["grad_diff"] < 1e-6 * r["grad_scale"], (shape, r)


@pytest.fixture
def context_run(worker):
    return findings(worker, "context")


def test_context_parallel_logits_and_gradients_equal_one_devices(context_run):
    """A sequence split over the context axis (ring attention, or keys and values gathered;
    zigzag order; tests/core/mesh_worker.py CONTEXT_CASES: RoPE with a window on (data 2,
    context 4), (context 8) and (tensor 2, context 4), ALiBi, T5 and FIRE on one each; GQA;
    the QK-norms head_after_rope and l2 and the xielu FFN beside some; a packed and padded
    batch): logits and every param's gradient equal the reference backend's on one device.
    The ring passes K/V with collective-permutes and its attention gathers nothing; the
    all-gather strategy gathers and passes nothing."""
    res = dict(context_run)
    res.pop("loss_sums")  # test_context_parallel_loss_is_one_devices_float64_loss
    # scanned and rematted: no per-block logits kept (a rank-8 stack) for the backward
    assert max(res.pop("scanned")) <= 6
    assert len(res) == 9 and {k.split()[0] for k in res} == {"rope", "alibi", "t5", "fire"}
    for name, r in res.items():
        assert r["logits_diff"] < 1e-5, (name, r)
        assert r["grad_diff"] < 2e-6 * r["grad_scale"], (name, r)
        if name.endswith("ring"):
            assert r["permutes"] > 0 and r["attention_gathers"] == 0, (name, r)
        else:
            assert r["permutes"] == 0 and r["attention_gathers"] > 0, (name, r)


def test_context_parallel_loss_is_one_devices_float64_loss(context_run):
    """train.py's loss (jaxformer.training.step.loss_sums: zigzag order, then the ring) of
    a packed, padded batch without positions on mesh (data 2, context 4) equals the float64
    loss of the reference backend's logits on one device in natural order
    (tests/core/mesh_worker.py context_loss_sums). RoPE and params of std 1 make the loss depend
    on order: a token, target, mask, segment id or position out of place moves it by 0.5%
    to 25%; rounding by < 3e-7."""
    r = context_run["loss_sums"]
    assert r["count"] == r["want_count"] > 0
    assert r["total"] == pytest.approx(r["want"], rel=1e-6)


def test_positions_study_evaluates_128L_on_a_context_mesh(worker):
    """The positions study's perplexity at 128 L with each window split over 8 devices
    (mesh.context=8) equals one device's."""
    res = findings(worker, "study_eval")
    assert res["split"]  # the 8-device evaluation ran attention under shard_map
    assert res["context 8"] == pytest.approx(res["context 1"], rel=1e-5)
    assert 1 < res["context 1"] < 1000


def test_every_mesh_trains_like_one_device(mesh_runs):
    ref = mesh_runs["None"]
    assert ref["skipped"] == [0, 0, 0] and ref["moved"] > 1e-3  # the steps did something
    for name in MESHES:
        run = mesh_runs[name]
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        for key, value in ref["params"].items():
            np.testing.assert_allclose(run["params"][key], value, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name} {key}")


def test_muon_on_a_mesh_updates_like_one_device(mesh_runs):
    """Muon's Newton-Schulz orthogonalisation of fsdp- and tensor-split matrices (the mesh
    (data 2, fsdp 2, tensor 2)) gives one device's update: the same losses and params."""
    ref, run, adamw = mesh_runs["muon None"], mesh_runs["muon (2, 2, 2)"], mesh_runs["None"]
    assert ref["skipped"] == [0, 0, 0] and ref["moved"] > 1e-3, ref["skipped"]
    kernel = "['blocks']['attn']['query']['kernel']"  # a matrix Muon orthogonalises
    assert np.abs(np.subtract(ref["params"][kernel], adamw["params"][kernel])).max() > 1e-4
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
    for key, value in ref["params"].items():
        np.testing.assert_allclose(run["params"][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def _expected_spec(path, shape, mesh):
    """The mesh axes DEFAULT_RULES give each dim of a param, written out by hand for the
    worker's model (scan_layers: a leading layers dim)."""
    sizes = dict(zip(MESH_AXES, mesh))
    leaf = path.split("']['")[-2:]  # e.g. ['query', 'kernel']
    names = {("query", "kernel"): ["layers", "embed", "heads", "head_dim"],
             ("key", "kernel"): ["layers", "embed", "kv_heads", "head_dim"],
             ("value", "kernel"): ["layers", "embed", "kv_heads", "head_dim"],
             ("out", "kernel"): ["layers", "heads", "head_dim", "embed"],
             ("query", "bias"): ["layers", "heads", "head_dim"],
             ("key", "bias"): ["layers", "kv_heads", "head_dim"],
             ("value", "bias"): ["layers", "kv_heads", "head_dim"],
             ("out", "bias"): ["layers", "embed"], ("wo", "bias"): ["layers", "embed"],
             ("wi_gate", "kernel"): ["layers", "embed", "mlp"],
             ("wi_up", "kernel"): ["layers", "embed", "mlp"],
             ("wi_gate", "bias"): ["layers", "mlp"], ("wi_up", "bias"): ["layers", "mlp"],
             ("wo", "kernel"): ["layers", "mlp", "embed"],
             ("embed", "embedding"): ["vocab", "embed"],
             ("position_bias", "relative_bias"): ["table", "heads"]}
    key = tuple(part.strip("[]'") for part in leaf)
    logical = names.get(key, ["layers", "norm"] if "blocks" in path else ["norm"])
    axis = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
            "vocab": "tensor"}
    spec = []
    for name, dim in zip(logical, shape):
        a = axis.get(name)
        spec.append([a] if a and dim % sizes[a] == 0 else [])
    return spec


def test_params_and_optimizer_state_are_sharded_as_the_rules_say(mesh_runs):
    for name in MESHES:
        mesh = tuple(int(s) for s in name.strip("()").split(","))
        run = mesh_runs[name]
        for path, shape in run["shapes"].items():
            assert run["specs"][path] == _expected_spec(path, shape, mesh), (name, path)
        moments = {k.split(".mu")[-1]: v for k, v in run["opt_specs"].items() if ".mu" in k}
        assert moments and all(moments[k] == run["specs"][k] for k in moments)
    # the worker's 2 kv heads cannot split 4 ways: those dims stay whole
    assert mesh_runs["(2, 1, 4)"]["specs"]["['blocks']['attn']['key']['kernel']"][2] == []


def test_per_device_bytes_shrink_by_the_expected_factor(mesh_runs):
    full = mesh_runs["None"]["bytes"]
    assert mesh_runs["(8, 1, 1)"]["bytes"] == full  # data parallel: every device a copy
    for name in MESHES:
        mesh = dict(zip(MESH_AXES, (int(s) for s in name.strip("()").split(","))))
        run = mesh_runs[name]
        expected = 0
        for path, shape in run["shapes"].items():
            split = np.prod([mesh[a[0]] for a in run["specs"][path] if a])
            expected += 4 * np.prod(shape) / split
            assert np.prod(run["shard_shapes"][path]) * split == np.prod(shape)
        assert run["bytes"] == expected
    fsdp = mesh_runs["(1, 8, 1)"]["bytes"]
    assert fsdp < full / 6  # everything but the norm scales split 8 ways


def test_checkpoint_restores_on_another_mesh_and_one_device(worker):
    res = findings(worker, "checkpoint")
    assert set(res) == {"(1, 8, 1)", "(8, 1, 1)", "one device"}
    for name, r in res.items():
        assert r["max_abs_diff"] == 0.0 and r["same_sharding"] and r["step"] == 1, name
    assert res["one device"]["devices"] == 1 and res["(1, 8, 1)"]["devices"] == 8


def test_decoding_with_tensor_parallel_params_equals_one_device(worker):
    res = findings(worker, "decode")
    for name, r in res.items():
        assert r["greedy_equal"] and r["sampled_equal"] and r["lengths_equal"], name
        assert r["greedy_logprob_diff"] < 1e-5
    assert res["(1, 2, 4)"]["query_spec"] == [[], ["fsdp"], ["tensor"], []]


# ---- two processes through train.py -----------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_and_a_context_mesh_train_like_one(tmp_path):
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words, size=6)) for _ in range(800)))
    seed = int(rng.integers(1000))
    common = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.max_seq_len=32",
              "train.seq_len=32", "train.batch_size=8", "train.steps=3", "train.log_every=1",
              "train.eval_batches=1", "train.sample_tokens=4", "train.progress=false",
              f"train.seed={seed}", "optim.warmup_steps=1", f"data.path={corpus}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags())
    one = subprocess.run([sys.executable, "train.py", *common, f"train.run_dir={tmp_path / 'one'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]

    env["XLA_FLAGS"] = xla_flags(devices=4)
    port, run = _free_port(), tmp_path / "two"
    procs = [subprocess.Popen(
        [sys.executable, "train.py", *common, f"train.run_dir={run}", "mesh.data=2",
         "mesh.fsdp=2", "mesh.tensor=2", f"distributed.coordinator_address=localhost:{port}",
         "distributed.num_processes=2", f"distributed.process_id={i}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    # gloo's C++ connection messages share stdout with Python's and can land mid-line
    gloo = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                      r"Expected number of connected peer ranks is : \d+\n?")
    assert "8 cpu device(s), 2 process(es)" in gloo.sub("", outs[0][0])
    # process 0 alone speaks for the run (gloo's threads may interleave their own lines)
    for marker in ("data:", "model:", "mesh:", "final:", "--- sample"):
        assert marker in outs[0][0] and marker not in outs[1][0], marker

    def losses(run_dir, key):
        return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}

    for key in ("loss", "val_loss"):
        ref, got = losses(tmp_path / "one", key), losses(run, key)
        assert sorted(got) == sorted(ref) and len(ref) >= 1
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (key, step)
    assert (run / "sample.txt").read_text() == (tmp_path / "one" / "sample.txt").read_text()
    assert sorted(os.listdir(run / "checkpoints")) == ["3"]

    # one process, the sequence split over 4 devices by the ring (zigzag order); its
    # sample is not compared: none drawn
    env["XLA_FLAGS"] = xla_flags(devices=8)
    ring = subprocess.run([sys.executable, "train.py", *common, "mesh.data=2", "mesh.context=4",
                           "model.attention_impl=ring", "train.sample_tokens=0",
                           f"train.run_dir={tmp_path / 'ring'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert ring.returncode == 0, ring.stderr[-3000:]
    assert "'context': 4" in ring.stdout
    for key in ("loss", "val_loss"):
        ref, got = losses(tmp_path / "one", key), losses(tmp_path / "ring", key)
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (key, step)
