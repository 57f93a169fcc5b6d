"""Expert parallelism (jaxformer.moe.expert_parallel): the mesh's expert axis, its config and
errors in process; on 8 fake CPU devices (one subprocess: tests/moe/expert_parallel_worker.py)
a tiny mixture's logits and gradients on expert meshes against the dense reference
dispatch on one device, train steps against one device, and the compiled program's
collectives."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxformer.core.sharding import (MESH_AXES, batch_devices, batch_sharding, make_mesh,
                                     mesh_shape, resolve_rules)
from jaxformer.core.validation import ConfigError
from jaxformer.training import load_config
from tests.conftest import REPO

pytestmark = pytest.mark.heavy  # run first: tests/conftest.py

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

TOLERANCE = 1e-5  # relative to the reference's largest magnitude: float32 rounding


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert") / "expert.json"
    seed = int(rng.integers(1 << 30))
    print(f"expert parallel worker: SEED={seed}")  # shown if a test using it fails
    env = dict(os.environ, PYTHONPATH=str(REPO), SEED=str(seed))
    proc = subprocess.run([sys.executable, "-m", "tests.moe.expert_parallel_worker", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


# ---- in process ------------------------------------------------------------------------


def test_mesh_has_an_expert_axis_that_the_batch_is_split_over():
    assert MESH_AXES[-1] == "expert"
    assert mesh_shape(2, 1, 1, 8, expert=-1) == (2, 1, 1, 1, 4)
    with pytest.raises(ConfigError, match="expert=4 = 8 devices, but there are 4"):
        mesh_shape(2, 1, 1, 4, expert=4)
    cfg = load_config(None, ["mesh.expert=-1"]).mesh
    assert (cfg.data, cfg.expert) == (1, -1)
    with pytest.raises(ConfigError, match="at most one"):
        load_config(None, ["mesh.expert=-1", "mesh.fsdp=-1"])
    rules = resolve_rules()
    assert dict(rules)["experts"] == "expert"
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert batch_sharding(mesh, rules).spec == P(("data", "fsdp", "expert"), "context")
    fake = type("Mesh", (), {"shape": {"data": 2, "fsdp": 3, "tensor": 5, "context": 7,
                                       "expert": 11}})
    assert batch_devices(fake, rules) == 2 * 3 * 11


def test_experts_not_divisible_by_the_expert_axis_is_one_config_error(capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.moe.experts=6", "mesh.expert=4"])
    assert str(e.value).startswith("model.moe.experts=6 is not divisible by mesh.expert=4")
    load_config(None, ["model.moe.experts=8", "mesh.expert=4"])  # a divisor: fine
    load_config(None, ["mesh.expert=4"])  # a dense model: the axis splits the batch
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["model.moe.experts=6", "mesh.expert=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.moe.experts=6 is not divisible "
                                               "by mesh.expert=4"), err


# ---- on 8 devices -----------------------------------------------------------------------


def test_logits_and_every_gradient_equal_one_device(worker):
    """Meshes (data 2, expert 4), (expert 8), (fsdp 2, expert 2, tensor 2) and (expert 4,
    context 2), with every expert reached and with experts 0, 4 and 5 (a whole device's at
    expert 4) reached by no token, against the dense dispatch on one device."""
    every, starved = worker["every expert"], worker["some get none"]
    assert np.min(every["load"]) > 0
    load = np.asarray(starved["load"])  # [layers, E]
    assert np.all(load[:, [0, 4, 5]] == 0) and np.all(np.delete(load, [0, 4, 5], 1) > 0)
    for draw in (every, starved):
        assert len(draw["meshes"]) == 4
        for name, run in draw["meshes"].items():
            assert run["all_to_all"] > 0, name  # it ran expert parallel
            assert run["logits"] < TOLERANCE, (name, run["logits"])
            worst = max(run["grads"], key=run["grads"].get)
            assert run["grads"][worst] < TOLERANCE, (name, worst, run["grads"][worst])


def test_train_steps_equal_one_device(worker):
    train = worker["train"]
    np.testing.assert_allclose(train["losses"], train["one_device"], rtol=TOLERANCE)
    assert train["params"] < 1e-4  # after 3 Adam steps at lr 1e-2


def _expert_kernel(shape, experts, d, f):
    """A shape of a (gathered) expert kernel: [E, D, F'] or [E, F', D], F' = F or a split
    of it, with or without a leading layers dim."""
    dims = shape[1:] if len(shape) == 4 else shape
    return len(dims) == 3 and dims[0] == experts and d in dims[1:] and \
        any(f % x == 0 for x in dims[1:] if x != d)


def test_compiled_step_sends_tokens_and_gathers_no_other_devices_experts(worker):
    """The compiled train step (data 2, expert 4) runs all-to-all and gathers no expert
    kernel with all 8 experts; on (fsdp 2, expert 2, tensor 2) each device gathers its own
    4 experts' kernels over fsdp (their embed axis), never all 8."""
    e, d, f = 8, 32, 12
    train = worker["train"]
    assert train["all_to_all"] > 0
    assert not [s for s in train["gathers"] if _expert_kernel(s, e, d, f)], train["gathers"]
    gathers = worker["every expert"]["meshes"]["fsdp 2, expert 2, tensor 2"]["gathers"]
    assert not [s for s in gathers if _expert_kernel(s, e, d, f)], gathers
    assert [4, 32, 6] in gathers and [4, 6, 32] in gathers, gathers  # its own, whole D
