"""objective.name=grpo (jaxformer.training.grpo_step): the task rewards against sums done
here, the update's gradient (each prompt's own group normalising its advantages) and KL
(against the reference weights, not the params being trained) against textbook
computations, a run whose Python reward sees every rollout (the logged means checked
against its scores, the ratio 1 at each first inner step, the KL 0 at the first step), a
task reward's one-program step against the same reward run on the host and against
itself on an 8-device mesh, and one-line errors for bad input."""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.data import DataConfig
from jaxformer.training.saved_run import load_run_params
from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, train
from jaxformer.training.config import ObjectiveConfig, RunConfig, TrainConfig
from jaxformer.training.grpo_step import GroupPolicy
from jaxformer.training.metrics import read_metrics
from jaxformer.training.rewards import Reward
from jaxformer.training.step import TrainState
from tests.conftest import REPO, np_log_softmax, xla_flags

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
CALLS = []
def counted(prompt, completion):
    CALLS.append(completion)
    return float(len(CALLS) % 4 + len(completion))
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


GROUP, PROMPTS, WIDTH, NEW, BETA = 4, 3, 5, 4, 0.3  # the update tests' rollout
TINY = ModelConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2, max_seq_len=WIDTH + NEW)


def gradient_keeper():
    """An optimizer that leaves the params as they are and keeps the last gradient as its
    state, wrapped in apply_if_finite as make_optimizer's is (the step reads its counts)."""
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    keep = optax.GradientTransformation(zeros, lambda g, state, params=None: (zeros(g), g))
    return optax.apply_if_finite(keep, max_consecutive_errors=1 << 30)


@functools.cache
def update_programs(chunk: int = 0):
    """(TINY's init, the GRPO step's update for TINY with objective.beta=BETA, one inner
    step and gradient_keeper, model.loss_chunk=chunk, a forward: logits [N, T, V], the
    gradient of the textbook loss at ratio 1), each jitted, compiled once for the tests
    that share them."""
    cfg = RunConfig(model=TINY, data=DataConfig(format="prompt_completion", path="r.jsonl"),
                    train=TrainConfig(init_from="reference", seq_len=TINY.max_seq_len,
                                      loss_chunk=chunk),
                    objective=ObjectiveConfig(name="grpo", reward="task:addition", beta=BETA,
                                              group_size=GROUP, inner_steps=1))
    model = Transformer(TINY)
    update = GroupPolicy(cfg).update_fn(model, gradient_keeper(), optax.constant_schedule(0.0),
                                        PROMPTS)

    def forward(params, seq):
        return model.apply({"params": params}, seq["tokens"], positions=seq["positions"],
                           segment_ids=seq["segment_ids"])

    def textbook(params, seq, adv, ref):
        """mean over completion tokens of -A log p + beta k3(ref - log p): GRPO's loss at
        ratio 1 (the surrogate's gradient there is A's policy gradient)."""
        logp = jax.nn.log_softmax(forward(params, seq)[:, :-1])  # [N, T - 1, V]
        new = jnp.take_along_axis(logp, seq["tokens"][:, 1:, None], -1)[..., 0]
        d = ref[:, 1:] - new
        per_token = -adv[:, None] * new + BETA * (jnp.exp(d) - d - 1)
        mask = seq["mask"][:, 1:]
        return jnp.sum(per_token * mask) / jnp.sum(mask)
    init = lambda key: model.init(key, jnp.zeros((1, 4), jnp.int32))["params"]  # noqa: E731
    return jax.jit(init), jax.jit(update), jax.jit(forward), jax.jit(jax.grad(textbook))


def draw_rollout(init, forward):
    """A rollout of PROMPTS prompts x GROUP completions (each prompt's rows in a row, as
    Rollouts.batch lays them out) from fresh params, with rewards whose level differs a
    lot from prompt to prompt; the reference weights (the params moved at random); the
    rows as NumPy sequences (prompt then completion: tokens, positions, segment_ids, mask
    on the completion); and each sequence's float64 log-probs (token t's at t) under both."""
    params = init(jax.random.key(int(rng.integers(1 << 30))))
    reference = jax.tree.map(lambda x: x + rng.normal(0, 0.3, x.shape).astype(x.dtype), params)
    n, t = PROMPTS * GROUP, WIDTH + NEW
    lengths = np.repeat(rng.integers(2, WIDTH + 1, PROMPTS), GROUP).astype(np.int32)
    prompts = np.repeat(rng.integers(0, TINY.vocab_size, (PROMPTS, WIDTH)), GROUP, 0)
    prompts = np.where(np.arange(WIDTH) < lengths[:, None], prompts, 0).astype(np.int32)
    tokens = rng.integers(0, TINY.vocab_size, (n, NEW)).astype(np.int32)
    counts = rng.integers(1, NEW + 1, n).astype(np.int32)
    seq = {k: np.zeros((n, t), np.int32) for k in ("tokens", "segment_ids", "mask")}
    for i in range(n):
        ids = np.concatenate([prompts[i, :lengths[i]], tokens[i, :counts[i]]])
        seq["tokens"][i, :len(ids)] = ids
        seq["segment_ids"][i, :len(ids)] = 1
        seq["mask"][i, lengths[i]:len(ids)] = 1
    seq["positions"] = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()

    def logps(p):
        lp = np_log_softmax(forward(p, seq))[:, :-1]  # [N, T - 1, V]
        at = np.take_along_axis(lp, seq["tokens"][:, 1:, None], -1)[..., 0]
        return np.concatenate([np.zeros((n, 1)), at], 1)  # [N, T]: token t's at t
    new, ref = logps(params), logps(reference)
    rewards = (np.repeat(rng.uniform(-40, 40, PROMPTS), GROUP)
               + rng.normal(0, 1, n)).astype(np.float32)
    old = np.stack([new[i, lengths[i]:lengths[i] + NEW] for i in range(n)])  # the ratio is 1
    rollout = dict(prompts=prompts, lengths=lengths, tokens=tokens,
                   logps=old.astype(np.float32), counts=counts, rewards=rewards)
    return params, reference, rollout, seq, new, ref


def np_group_advantages(rewards):
    """float64: each prompt's GROUP rewards less their mean, over their sample std + 1e-4
    (group_advantages' std="sample", the step's)."""
    r = np.asarray(rewards, np.float64).reshape(PROMPTS, GROUP)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()


def run_update(update, params, reference, rollout):
    """The update's metrics and the gradient it took (gradient_keeper's state)."""
    tx = gradient_keeper()
    state = TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params),
                       rng=jax.random.PRNGKey(0))
    new_state, metrics = update(state, rollout, reference)
    return jax.device_get(metrics), new_state.opt_state.inner_state


def test_the_update_normalises_each_prompts_rewards_within_its_own_group():
    """With rewards whose level differs by tens from prompt to prompt, the update's
    gradient (at ratio 1) is that of the textbook loss with float64 NumPy advantages
    normalised within each prompt's group: grouping rows across prompts, or over the
    whole batch, gives other advantages and another gradient. The update runs with
    model.loss_chunk=4 (the policy's and reference's log-probs through the head 4
    positions at a time; test_the_update_kl_...: the whole logits), and its ratio starts
    at 1 against the rollout's log-probs of the whole logits."""
    init, update, forward, textbook = update_programs(4)
    params, reference, rollout, seq, _, ref = draw_rollout(init, forward)
    adv = np_group_advantages(rollout["rewards"])
    metrics, got = run_update(update, params, reference, rollout)
    want = textbook(params, seq, jnp.asarray(adv, jnp.float32), jnp.asarray(ref, jnp.float32))
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale),
                 got, want)
    assert abs(float(metrics["ratio_first"]) - 1) < 1e-5


def test_the_update_kl_is_against_the_reference_weights():
    """The update's logged KL (its first inner step's, at the params it starts from) is the
    mean k3 over completion tokens between those params' and the reference weights'
    float64 log-probs, and its loss -mean(A) + beta KL; were the reference read from
    the params being trained, the KL would be 0."""
    init, update, forward, _ = update_programs()
    params, reference, rollout, seq, new, ref = draw_rollout(init, forward)
    metrics, _ = run_update(update, params, reference, rollout)
    mask = seq["mask"].astype(bool)
    d = (ref - new)[mask]
    kl = np.mean(np.exp(d) - d - 1)
    assert kl > 1e-2  # the two disagree
    np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-5)
    adv = np.repeat(np_group_advantages(rollout["rewards"]), seq["mask"].sum(1))
    np.testing.assert_allclose(metrics["loss"], -adv.mean() + BETA * kl, rtol=1e-4, atol=1e-5)


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


def same_run(a, b, tol, params_tol, later_tol=None):
    """Two runs' logged rewards, their spreads and the completion lengths equal (all are
    counted from the same sampled tokens), their other metrics within tol at the first
    step and within later_tol (default tol) at the second, and their final params within
    params_tol (Adam moves a param whose gradients are ~0 by up to lr a step, so float
    differences in those show at ~1e-3 of lr)."""
    ma, mb = ([r for r in read_metrics(d) if "reward_mean" in r] for d in (a, b))
    assert len(ma) == len(mb) == 2
    for step, (x, y) in enumerate(zip(ma, mb)):
        for k in ("reward_mean", "reward_std", "completion_len"):
            assert x[k] == y[k], (step, k, x[k], y[k])
        bound = tol if step == 0 or later_tol is None else later_tol
        for k in ("loss", "grad_norm", "ratio_mean", "kl"):
            assert math.isclose(x[k], y[k], rel_tol=bound, abs_tol=bound), (step, k, x[k], y[k])
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
    # two programs: their float rounding differs, and after one update the second step's
    # gradients differ by ~1e-4 relative on some CPUs (AMD EPYC: grad_norm 0.322034 vs
    # 0.322071), the final params by ~2e-5
    same_run(fused, hosted, 1e-5, 1e-4, later_tol=1e-3)


def test_the_one_program_step_on_a_mesh_equals_one_device(sft, one_program, tmp_path):
    """On 8 devices (data 2, fsdp 2, tensor 2) the task:addition run equals one device's:
    the same sampled tokens (rewards and lengths equal), the first step's metrics within
    float32 reduction order, and the second step's within that order as three AdamW
    updates amplify it.

    The second bound is measured, not derived: AdamW's first update moves each param by
    lr g / (|g| + eps), so a param whose gradient is near eps (1e-8; the float32 error of
    its reduction there is ~1e-3 of it) moves by a good part of lr carrying that relative
    error, and the second step's last gradient (grad_norm: the KL's alone, every reward 0)
    reads those params. Its relative gap was 1.7e-4 (AMD) and 3.9e-4 (Intel) between one
    device and the mesh at the suite's XLA flags, and 6e-4 between one device at those
    flags and one device at XLA's default optimisation (no mesh at all), with the sampled
    tokens, rewards and advantages equal and the first step's metrics within 3e-7; the
    second step's other metrics moved by <= 4e-6. 5e-3 is 7 times the widest gap. The
    final params (four updates of lr 1e-2) differed by up to 3.8e-5 in those pairs: 3e-4
    is 8 times that."""
    _, _, grpo = sft
    args = [*grpo, *ONE_PROGRAM, "objective.reward=task:addition", "mesh.data=2",
            "mesh.fsdp=2", "mesh.tensor=2", f"train.run_dir={tmp_path / 'mesh'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), GRPO_ARGS=json.dumps(args),
               XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, "-m", "tests.core.mesh_worker", "grpo",
                           str(tmp_path / "out.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text()) == {"devices": 8}
    same_run(one_program[0], tmp_path / "mesh", 1e-5, 3e-4, later_tol=5e-3)


GREEDY = [*ONE_PROGRAM[:-1], "objective.temperature=0", "optim.eps=1.0"]


@pytest.mark.parametrize("reward", ["task:addition", "grpo_rewards_mod:counted"])
def test_rollouts_through_the_engine_make_generates_run(sft, tmp_path, reward):
    """objective.rollout=engine (the serving engine before the jitted program) with greedy
    rollouts: the run objective.rollout=generate makes, with a task reward (one program)
    and with a Python reward on the host; the latter's rewards differ within a group (they
    count its calls), so the update moves the params by the rollouts' tokens and
    log-probs; the first inner step's ratio is 1 (the engine's log-probs are the training
    forward's)."""
    _, _, grpo = sft
    for name in ("generate", "engine"):
        sys.modules.get("grpo_rewards_mod", sys).__dict__.get("CALLS", []).clear()
        train(load_config(None, [*grpo, *GREEDY, f"objective.reward={reward}",
                                 f"objective.rollout={name}", f"train.run_dir={tmp_path / name}"]),
              log=lambda *a: None)
    rows = [r for r in read_metrics(tmp_path / "engine") if "reward_mean" in r]
    assert all(r["rollout_s"] > 0 and abs(r["ratio_first"] - 1) < 1e-5 for r in rows)
    same_run(tmp_path / "generate", tmp_path / "engine", 1e-5, 1e-5)


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
