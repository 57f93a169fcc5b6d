"""objective.name=grpo (jaxformer.training.grpo_step): the task rewards against sums done
here, a run whose Python reward sees every rollout (the logged means checked against
its scores, the ratio 1 at each first inner step, the KL 0 at the first step), a task
reward's one-program step against the same reward run on the host and against itself on
an 8-device mesh, and one-line errors for bad input."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxformer.config import ConfigError
from jaxformer.generate import load_run_params
from jaxformer.training import load_config, train
from jaxformer.training.metrics import read_metrics
from jaxformer.training.rewards import Reward
from tests.conftest import REPO, xla_flags

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

_spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

SFT = ["model.preset=tiny", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
       "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=8", "train.log_every=1",
       "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
       "optim.warmup_steps=0", "data.val_fraction=0.2", "data.format=prompt_completion"]
REWARDS = '''
SEEN = []
def digits(prompt, completion):
    SEEN.append((prompt, completion))
    return float(sum(ch.isdigit() for ch in completion))
def boom(prompt, completion):
    raise ValueError("no\\nway")
def nothing(prompt, completion):
    return None
'''


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A 40-step fine-tune on "a+b=" -> "a + b\\n" records: (its run dir, the records,
    the args a GRPO run from it takes, the reward module's name)."""
    tmp = tmp_path_factory.mktemp("grpo")
    r = np.random.default_rng(0)
    records = [{"prompt": f"{a}+{b}=", "completion": f"{a + b}\n"}
               for a, b in r.integers(0, 5, (200, 2)).tolist()]
    data = tmp / "sums.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in records) + "\n")
    common = [f"data.path={data}", f"data.cache_dir={tmp / 'c'}"]
    train(load_config(None, [*SFT, *common, "train.steps=40", f"train.run_dir={tmp / 'sft'}"]),
          log=lambda *a: None)
    (tmp / "grpo_rewards_mod.py").write_text(REWARDS)
    sys.path.insert(0, str(tmp))
    grpo = [a for a in SFT if not a.startswith("model.")] + common + [
        f"train.init_from={tmp / 'sft'}", "objective.name=grpo", "model.max_seq_len=32"]
    yield tmp, records, grpo
    sys.path.remove(str(tmp))


def test_task_rewards_are_exact_match_on_the_first_line():
    a, b = (int(x) for x in rng.integers(-10**6, 10**6, 2))
    word = "".join(chr(c) for c in rng.integers(97, 123, 7))
    right = Reward("task:addition")
    assert right([f"q: {a}+{b}="] * 4, [f"{a + b}", f" {a + b}\nrest", f"{a + b + 1}",
                                        f"{a + b}0"], [None] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert Reward("task:copy")([f"copy {word}="] * 3, [word, f"{word}\n1", word[:-1]],
                               [None] * 3) == [1.0, 1.0, 0.0]
    assert Reward("task:exact")(["p"] * 2, [f"{word}\n", word + "x"], [word] * 2) == [1.0, 0.0]


@pytest.mark.parametrize("spec, needle", [
    ("task:nope", "objective.reward=task:nope: no such task"),
    ("no_such_module_here:f", "objective.reward=no_such_module_here:f cannot be loaded")])
def test_unknown_rewards_are_refused(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        Reward(spec)


def test_a_run_scores_every_rollout_and_starts_each_update_at_ratio_one(sft):
    """3 steps of 4 prompts x 4 completions, 2 inner steps each: the reward function sees
    each group's prompt 4 times, and each step's logged reward_mean is the mean of the
    scores it returned; the first inner step's ratio is 1 (the rollout's log-probs are
    the training forward's) and the KL is 0 while the policy is still the reference."""
    tmp, records, grpo = sft
    steps, prompts, group, new = 3, 4, 4, 3
    train(load_config(None, [
        *grpo, "objective.reward=grpo_rewards_mod:digits", f"objective.group_size={group}",
        f"objective.max_new_tokens={new}", f"train.batch_size={prompts}",
        f"train.steps={steps}", "objective.inner_steps=2", "optim.lr=1e-2",
        "optim.schedule=constant", f"train.run_dir={tmp / 'run'}"]), log=lambda *a: None)
    seen = sys.modules["grpo_rewards_mod"].SEEN
    assert len(seen) == steps * prompts * group
    known = {r["prompt"] for r in records}
    for g in range(0, len(seen), group):
        assert len({p for p, _ in seen[g:g + group]}) == 1 and seen[g][0] in known
    logged = [r for r in read_metrics(tmp / "run") if "reward_mean" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    per_step = prompts * group
    for i, rec in enumerate(logged):
        scores = [sum(ch.isdigit() for ch in c) for _, c in seen[i * per_step:(i + 1) * per_step]]
        assert math.isclose(rec["reward_mean"], np.mean(scores), rel_tol=1e-6)
        assert abs(rec["ratio_first"] - 1) < 1e-4, rec
        assert rec["rollout_s"] > 0 and rec["update_s"] > 0
    assert logged[0]["kl"] < 1e-7
    assert abs(logged[-1]["ratio_mean"] - 1) > 1e-6  # the second inner step moved


ONE_PROGRAM = ["objective.group_size=4", "objective.max_new_tokens=3", "train.batch_size=8",
               "train.steps=2", "objective.inner_steps=2", "optim.lr=1e-2", "objective.beta=0.1",
               "optim.schedule=constant", "objective.temperature=1.5"]


@pytest.fixture(scope="module")
def one_program(sft):
    """A task:addition run (one jitted program a step) and the same reward as a Python
    function (rollout, host reward, update): their run dirs."""
    tmp, _, grpo = sft
    for name, reward in (("fused", "task:addition"),
                         ("hosted", "jaxformer.training.rewards:addition")):
        train(load_config(None, [*grpo, *ONE_PROGRAM, f"objective.reward={reward}",
                                 f"train.run_dir={tmp / name}"]), log=lambda *a: None)
    return tmp / "fused", tmp / "hosted"


def same_run(a, b, tol, params_tol):
    """Two runs' logged rewards equal, their other metrics within tol and final params
    within params_tol (Adam moves a param whose gradients are ~0 by up to lr a step, so
    float differences in those show at ~1e-3 of lr)."""
    ma, mb = ([r for r in read_metrics(d) if "reward_mean" in r] for d in (a, b))
    assert len(ma) == len(mb) == 2
    for x, y in zip(ma, mb):
        assert x["reward_mean"] == y["reward_mean"] and x["reward_std"] == y["reward_std"]
        for k in ("loss", "grad_norm", "ratio_mean", "kl", "completion_len"):
            assert math.isclose(x[k], y[k], rel_tol=tol, abs_tol=tol), (k, x[k], y[k])
    pa, pb = (load_run_params(d)[1] for d in (a, b))
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=params_tol,
                                   atol=params_tol)


def test_a_task_reward_in_the_step_is_the_python_reward_on_the_host(one_program):
    """task:addition runs inside the jitted step (no host stage is timed) and makes the
    run the Python function makes between two programs; some rollouts score 1."""
    fused, hosted = one_program
    rows = [r for r in read_metrics(fused) if "reward_mean" in r]
    assert "rollout_s" not in rows[0]
    assert all("rollout_s" in r for r in read_metrics(hosted) if "reward_mean" in r)
    assert sum(r["reward_mean"] for r in rows) > 0
    same_run(fused, hosted, 1e-5, 1e-5)


def test_the_one_program_step_on_a_mesh_equals_one_device(sft, one_program, tmp_path):
    """On 8 devices (data 2, fsdp 2, tensor 2) the task:addition run equals one device's."""
    _, _, grpo = sft
    args = [*grpo, *ONE_PROGRAM, "objective.reward=task:addition", "mesh.data=2",
            "mesh.fsdp=2", "mesh.tensor=2", f"train.run_dir={tmp_path / 'mesh'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), GRPO_ARGS=json.dumps(args),
               XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "grpo",
                           str(tmp_path / "out.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text()) == {"devices": 8}
    same_run(one_program[0], tmp_path / "mesh", 1e-5, 1e-4)  # lr 1e-2


def test_bad_input_stops_in_one_line(sft, capsys):
    tmp, _, grpo = sft
    cheap = ["train.steps=1", "train.batch_size=2", "objective.group_size=2",
             "objective.max_new_tokens=2"]
    run = lambda i: f"train.run_dir={tmp / f'bad{i}'}"  # noqa: E731
    cases = [([*grpo], ["objective.name=grpo needs objective.reward"]),
             ([*grpo, "objective.reward=task:nope"], ["no such task", "task:addition"]),
             ([*grpo, "objective.reward=grpo_rewards_mod:boom", *cheap],
              ["objective.reward=grpo_rewards_mod:boom raised ValueError: no way"]),
             ([*grpo, "objective.reward=grpo_rewards_mod:nothing", *cheap],
              ["objective.reward=grpo_rewards_mod:nothing returned None"]),
             ([*grpo, "objective.reward=task:copy", "data.format=text"],
              ["objective.name=grpo with data.format=text"])]
    for i, (argv, needles) in enumerate(cases):
        assert cli.main([*argv, run(i)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        for needle in needles:
            assert needle in err, (needle, err)
