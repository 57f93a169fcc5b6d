"""End-to-end training: loss goes down, resume is exact, kills and signals lose nothing,
non-finite steps are skipped, and a checkpoint refuses another model config."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.data import Dataset
from jaxformer.model.config import ConfigError
from jaxformer.model.transformer import Transformer, flops_per_token
from jaxformer.training import TrainingStopped, load_config, loop, train
from jaxformer.training.metrics import read_metrics
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_eval_step, make_train_step
from tests.conftest import REPO, np_global_norm, np_log_softmax

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.batch_size=4", "train.log_every=1", "train.eval_batches=2",
        "train.sample_tokens=8", "train.progress=false", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text whose statistics a tiny model can learn in a few dozen steps (the
    same text every run: it is the setting, not an input under test)."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x", "y"]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 9))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines))
    return path


def config(corpus, run_dir, *extra):
    return load_config(str(REPO / "configs/tiny.yaml"),
                       [*TINY, f"data.path={corpus}", f"train.run_dir={run_dir}",
                        f"data.cache_dir={run_dir.parent / 'cache'}", *extra])


def random_batch(rng, vocab_size, rows, keep=1.0):
    """A batch of `rows` random windows of 32 tokens; each target counts with probability
    `keep` (loss_mask)."""
    tokens = rng.integers(0, vocab_size, (rows, 33)).astype(np.int32)
    mask = np.ones((rows, 32), np.float32) if keep == 1 else rng.random((rows, 32)) < keep
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": mask.astype(np.float32)}


def restored_state(cfg, run, step=None):
    """The train state saved in `run` at `step` (default: the latest)."""
    from jaxformer.training.adapter_checkpoint import run_checkpointer
    from jaxformer.training.initial_weights import one_device_loader
    from jaxformer.training.step import abstract_state
    model = Transformer(cfg.model)
    tx, _ = make_optimizer(cfg.optim, cfg.model, cfg.train.steps)
    ckpt = run_checkpointer(cfg, run, load=one_device_loader(cfg), keep=5)
    state = ckpt.restore(abstract_state(model, tx), cfg.model, step=step)
    ckpt.close()
    return state


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def resumed_like_straight(make_cfg, tmp_path, steps: int = 6, every: int = 3, drop=()):
    """A run of make_cfg(tmp_path / "straight") for `steps` steps (checkpoints every
    `every`), then a copy of it, its last checkpoint, its metrics and `drop` (folders) removed,
    resumed as make_cfg(tmp_path / "resumed"): it starts at steps - every and repeats the
    straight run's losses bit for bit. (the straight run's config and summary, its folder,
    the resumed one's) for more checks."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cfg = make_cfg(straight)
    summary = train(cfg, log=lambda *a: None)
    shutil.copytree(straight, resumed)
    for name in (f"checkpoints/{steps}", *drop):
        shutil.rmtree(resumed / name)
    (resumed / "metrics.jsonl").unlink()
    start = steps - every
    assert train(make_cfg(resumed), log=lambda *a: None)["start_step"] == start
    a, b = losses(straight), losses(resumed)
    assert set(b) == set(range(start + 1, steps + 1)) and all(a[k] == b[k] for k in b), (a, b)
    return cfg, summary, straight, resumed


def same_saved_state(cfg, straight, resumed):
    """The two runs' latest train states (params and optimizer state) equal bit for bit;
    the straight run's."""
    a, b = restored_state(cfg, straight), restored_state(cfg, resumed)
    same_bits = jax.tree.leaves(jax.tree.map(np.array_equal, a, b))
    assert len(same_bits) > 10 and all(same_bits)
    return a


def cosine_lr(step, peak, warmup, total, min_ratio):
    """The cosine schedule by its definition: linear warmup from 0, then half a cosine from
    peak to peak * min_ratio, reached at `total`."""
    if step < warmup:
        return peak * step / warmup
    end = peak * min_ratio
    return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (step - warmup) / (total - warmup)))


def hand_val_loss(cfg, run, step):
    """The validation loss by hand: the params saved at `step`, over the first
    eval_batches x batch_size windows of the val split (window j = tokens j*T .. j*T + T)."""
    from jaxformer.data import load_dataset
    model, params = Transformer(cfg.model), restored_state(cfg, run, step).params
    val = np.asarray(load_dataset(cfg.data, run_dir=str(run)).val)
    T, n = cfg.train.seq_len, cfg.train.eval_batches * cfg.train.batch_size
    windows = np.stack([val[j * T:j * T + T + 1] for j in range(n)]).astype(np.int32)
    logits = jax.jit(model.apply)({"params": params}, windows[:, :-1])
    return float(np_nll(logits, windows[:, 1:]).mean())


def test_short_run_learns_and_writes_everything(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(loop, "peak_flops", lambda dtype: (1e9, "a test's peak"))
    cfg = config(corpus, run, "train.steps=40", "train.eval_every=20", "checkpoint.every=20",
                 "train.log_every=4")
    summary = train(cfg, log=lambda *a: None)
    records = read_metrics(run)
    train_losses = [r["loss"] for r in records if "loss" in r]
    assert train_losses[-1] < 0.6 * train_losses[0]
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [20, 40]
    assert summary["val_loss"] == vals[-1]["val_loss"] < np.log(256) * 0.6
    assert vals[-1]["val_ppl"] == pytest.approx(np.exp(vals[-1]["val_loss"]))
    for v in vals:  # evaluation reads the val split, with the params of that step
        assert v["val_loss"] == pytest.approx(hand_val_loss(cfg, run, v["step"]), rel=1e-5)
    o = cfg.optim
    assert [r["step"] for r in records if "loss" in r] == list(range(4, 41, 4))
    for r in (r for r in records if "loss" in r):  # step k logs the lr it used: the k-th
        assert r["lr"] == pytest.approx(cosine_lr(r["step"] - 1, o.lr, o.warmup_steps, 40,
                                                  o.min_lr_ratio), rel=1e-5, abs=1e-12)
        assert r["grad_norm"] > 0 and r["skipped"] == 0
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token(cfg.model, 32) / 1e9)
    for name in ("config.yaml", "tokenizer.json", "metrics.jsonl", "loss.png", "sample.txt"):
        assert (run / name).is_file(), name
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [20, 40]
    assert len(list((run / "best").iterdir())) == 1


@pytest.mark.parametrize("log_every", [1, 3])
def test_tokens_per_s_times_each_window_of_steps(corpus, tmp_path, monkeypatch, log_every):
    """With a clock that moves 1 s per train step call (and only then), every logged
    window, the last included, reports tokens_per_step tokens per second. On one CPU
    device the step runs inside the call, so timing a step when its metrics are read
    counted the next step too, and left the last window almost no time."""
    clock = [0.0]
    monkeypatch.setattr(loop, "time", type("FakeTime", (), {
        "perf_counter": staticmethod(lambda: clock[0])}))
    make = loop.make_train_step

    def timed_step(*args, **kwargs):
        step = make(*args, **kwargs)

        def run(*a):
            clock[0] += 1.0
            return step(*a)
        return run

    monkeypatch.setattr(loop, "make_train_step", timed_step)
    cfg = config(corpus, tmp_path / "run", "train.steps=7", f"train.log_every={log_every}",
                 "train.eval_every=1000", "checkpoint.every=1000", "train.sample_tokens=0")
    train(cfg, log=lambda *a: None)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == [k for k in range(1, 8) if k % log_every == 0] + \
        ([7] if 7 % log_every else [])
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(cfg.train.batch_size * cfg.train.seq_len), r


def test_stop_and_resume_equals_straight_run(corpus, tmp_path):
    """A run stopped after step k (here by SIGTERM) and resumed gives bitwise the same
    losses at every later step as the uninterrupted run: dropout, and randomized positions
    drawn for packed documents, included."""
    same = ("train.steps=10", "checkpoint.every=100", "model.dropout=0.1", "data.pack=true",
            "train.random_positions=300")
    straight = tmp_path / "straight"
    train(config(corpus, straight, *same), log=lambda *a: None)
    resumed = tmp_path / "resumed"
    cfg = config(corpus, resumed, *same)
    calls = {"n": 0}
    real_batch = Dataset.train_batch

    def batch_then_sigterm(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(*args, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Dataset, "train_batch", batch_then_sigterm)
        summary = train(cfg, log=lambda *a: None)
    assert summary["stopped_early"] and summary["step"] == 5
    summary = train(cfg, log=lambda *a: None)
    assert summary["start_step"] == 5 and summary["step"] == 10
    a, b = losses(straight), losses(resumed)
    assert set(b) == set(range(1, 11))
    for step in range(1, 11):
        assert a[step] == b[step], (step, a[step], b[step])


def test_sigkill_mid_run_then_resume(corpus, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(REPO / "train.py"), *TINY, f"data.path={corpus}",
            f"train.run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=30",
            "checkpoint.every=3", "train.eval_every=1000", "model.dropout=0.1"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        steps = [p for p in (run / "checkpoints").glob("*") if p.name.isdigit()] \
            if (run / "checkpoints").exists() else []
        if len(steps) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    summary = train(config(corpus, run, "train.steps=30", "checkpoint.every=3",
                           "train.eval_every=1000", "train.sample_tokens=0", "model.dropout=0.1"),
                    log=lambda *a: None)
    assert summary["start_step"] > 0 and summary["start_step"] % 3 == 0
    assert summary["step"] == 30
    # every step logged, by the killed run or the resumed one, is the uninterrupted run's
    straight = tmp_path / "straight"
    train(config(corpus, straight, "train.steps=30", "checkpoint.every=100",
                 "train.eval_every=1000", "train.sample_tokens=0", "model.dropout=0.1"),
          log=lambda *a: None)
    want, logged = losses(straight), [r for r in read_metrics(run) if "loss" in r]
    assert {r["step"] for r in logged} == set(range(1, 31))
    for r in logged:
        assert r["loss"] == want[r["step"]], (r, want[r["step"]])


def test_sigterm_saves_and_exits_zero(corpus, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(REPO / "train.py"), *TINY, f"data.path={corpus}",
            f"train.run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=100000",
            "checkpoint.every=100000", "train.eval_every=100000"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    saved = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    last_logged = max(r["step"] for r in read_metrics(run) if "loss" in r)
    assert len(saved) == 1 and saved[0] >= last_logged


def test_nonfinite_step_leaves_state_unchanged(rng):
    cfg = load_config(str(REPO / "configs/tiny.yaml"), TINY).model
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 10)
    step = make_train_step(model, tx, schedule)
    batch = random_batch(rng, cfg.vocab_size, 4)
    state, _ = step(init_state(model, tx, 0), batch)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state.inner_state))
    bad = dict(batch, loss_mask=np.where(rng.random((4, 32)) < 0.1, np.nan, 1.0).astype(np.float32))
    state, m = step(state, bad)
    after = jax.tree.map(np.asarray, (state.params, state.opt_state.inner_state))
    assert int(m["skipped"]) == 1 and int(m["consecutive_skips"]) == 1 and int(state.step) == 2
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
    state, m = step(state, batch)
    assert int(m["skipped"]) == 0 and int(m["consecutive_skips"]) == 0


def test_too_many_skips_stop_the_run_with_a_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    real_batch = Dataset.train_batch

    def poisoned(*args, step, **kw):
        batch = real_batch(*args, step=step, **kw)
        if step >= 3:
            batch["loss_mask"] = batch["loss_mask"] * np.float32(np.nan)
        return batch

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Dataset, "train_batch", poisoned)
        with pytest.raises(TrainingStopped, match="4 consecutive steps had non-finite"):
            train(config(corpus, run, "train.steps=50", "optim.max_skips=4",
                         "checkpoint.every=1000"), log=lambda *a: None)
    saved = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and max(saved) >= 7


def test_nonfinite_validation_loss_stops_the_run(corpus, tmp_path, monkeypatch):
    real = loop.make_eval_step

    def diverged(*args, **kwargs):  # the model's loss turns NaN
        step = real(*args, **kwargs)

        def nan_step(params, batch):
            total, count = step(params, batch)
            return total * np.nan, count
        return nan_step

    monkeypatch.setattr(loop, "make_eval_step", diverged)
    said = []
    with pytest.raises(TrainingStopped, match="validation loss at step 4 is nan: the model "
                                              "has diverged.*lower optim.lr"):
        train(config(corpus, tmp_path / "run", "train.steps=8", "train.eval_every=4"),
              log=said.append)
    assert not any("final:" in line for line in said)


def test_nonfinite_params_in_the_checkpoint_stop_the_resume(corpus, tmp_path):
    from jaxformer.training.checkpoint import Checkpointer
    run = tmp_path / "run"
    cfg = config(corpus, run, "train.steps=2", "train.sample_tokens=0")
    train(cfg, log=lambda *a: None)
    state = restored_state(cfg, run)
    ckpt = Checkpointer(run, keep=5, async_save=False)
    params = jax.tree.map(np.array, state.params)  # (writable copies)
    params["block_1"]["ffn"]["wi"]["kernel"][0, 0] = np.inf
    ckpt.save(3, state.replace(params=params, step=jnp.int32(3)), cfg.model)
    ckpt.close()
    with pytest.raises(TrainingStopped, match=r"checkpoints/3 holds non-finite params \(1 "
                                              r"arrays, e.g. \['block_1'\]\['ffn'\]"):
        train(config(corpus, run, "train.steps=6"), log=lambda *a: None)


def test_restore_with_another_model_config_fails_clearly(corpus, tmp_path):
    run = tmp_path / "run"
    train(config(corpus, run, "train.steps=2", "train.sample_tokens=0"), log=lambda *a: None)
    with pytest.raises(ConfigError) as e:
        train(config(corpus, run, "train.steps=4", "model.n_layers=3", "model.ffn=swiglu"),
              log=lambda *a: None)
    msg = str(e.value)
    assert "another model config" in msg and "n_layers: 2 -> 3" in msg and "ffn: 'gelu' -> " \
        "'swiglu'" in msg and "train.run_dir" in msg


def test_a_refused_resume_leaves_the_runs_config_yaml_byte_for_byte(corpus, tmp_path):
    """config.yaml is written once the resume check has passed: a run refused for another
    model or optimizer still loads as it was trained (generate, convert, a later resume)."""
    run = tmp_path / "run"
    train(config(corpus, run, "train.steps=2", "train.sample_tokens=0"), log=lambda *a: None)
    saved = (run / "config.yaml").read_bytes()
    for change, says in [("model.n_layers=1", "another model config"),
                         ("optim.name=lion", "a train state of another shape than this "
                          "run's \\(this run's optimizer settings differ from the run dir's "
                          "config.yaml: optim.name: 'adamw' -> 'lion'"),
                         ("train.resume=never", "already holds checkpoints")]:
        with pytest.raises(ConfigError, match=says):
            train(config(corpus, run, "train.steps=4", change), log=lambda *a: None)
        assert (run / "config.yaml").read_bytes() == saved, change
    assert load_config(str(run / "config.yaml")).model.n_layers == 2
    said = []  # a resume that has nothing left to train says so; one with other compute
    # settings (model.COMPUTE_ONLY: no saved state depends on them) restores, saying so
    summary = train(config(corpus, run, "train.steps=1", "train.sample_tokens=0",
                           "model.remat=full", "model.matmul_precision=fp8_rowwise"),
                    log=said.append)
    assert f"resumed from {run}/checkpoints/2; train.steps=1 is not past it: nothing to " \
        "train (the final evaluation only); raise train.steps to train on" in said, said
    assert f"checkpoint {run}/checkpoints/2 was made with other compute settings " \
        "(matmul_precision: 'default' -> 'fp8_rowwise'; remat: 'none' -> 'full'): restored, " \
        "run with this run's" in said, said
    assert summary["start_step"] == 2 and "val_loss" in summary
    assert load_config(str(run / "config.yaml")).model.matmul_precision == "fp8_rowwise"


def test_a_run_dir_that_is_a_file_is_one_line(corpus, tmp_path):
    (tmp_path / "file").write_text("notes")
    for run_dir, says in [("file", "is a file; choose a directory"),
                          ("file/run", f"is inside {tmp_path / 'file'}, a file; choose a "
                                       "directory")]:
        with pytest.raises(ConfigError) as e:
            train(config(corpus, tmp_path / run_dir), log=lambda *a: None)
        assert str(e.value) == f"train.run_dir={tmp_path / run_dir} {says}"
    assert (tmp_path / "file").read_text() == "notes"


def tiny_step_setup(*overrides, steps=10):
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [*TINY, *overrides])
    model = Transformer(cfg.model)
    tx, schedule = make_optimizer(cfg.optim, cfg.model, steps)
    return cfg.model, model, tx, schedule


def np_nll(logits, targets):
    """float64 next-token negative log-likelihoods: logits [..., V], targets [...]."""
    logp = np_log_softmax(logits)
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def nll_alone(model, params, docs, width):
    """float64 next-token NLLs of each document run alone, from position 0 ([len(d) - 1]
    each); they share one forward, each in its own row (causal: what follows a document in
    its row does not change it)."""
    alone = np.zeros((len(docs), width), np.int32)
    for i, d in enumerate(docs):
        alone[i, :len(d)] = d
    logits = jax.jit(model.apply)({"params": params}, alone[:, :-1])
    return [np_nll(logits[i, :len(d) - 1], d[1:]) for i, d in enumerate(docs)]


def test_packed_evaluation_is_its_documents_run_apart(rng):
    """With data.pack, the validation loss over windows that cut across documents is the
    mean of each document piece's own next-token losses, each piece run alone."""
    cfg = load_config(str(REPO / "configs/tiny.yaml"),
                      [*TINY, "data.pack=true", "train.batch_size=2", "train.eval_batches=2"])
    model, T = Transformer(cfg.model), cfg.train.seq_len
    # 44 documents of >= 3 tokens: always the 4 T + 1 tokens of the 4 windows compared below
    # (16 documents fell short for some seeds, and evaluation then read fewer windows)
    docs = [rng.integers(0, cfg.model.vocab_size, n) for n in rng.integers(3, 20, 44)]
    tokens, starts = np.concatenate(docs), np.cumsum([0] + [len(d) for d in docs[:-1]])
    assert len(tokens) >= 4 * T + 1
    tx, _ = make_optimizer(cfg.optim, cfg.model, 10)
    params = jax.device_get(init_state(model, tx, int(rng.integers(1 << 30))).params)
    got = loop.evaluate(make_eval_step(model), params, tokens, starts, cfg)["val_loss"]
    pieces = []
    for j in range(4):  # the windows: tokens j*T .. j*T + T
        doc = np.searchsorted(starts, np.arange(j * T, j * T + T + 1), side="right") - 1
        pieces += np.split(tokens[j * T:j * T + T + 1], np.flatnonzero(np.diff(doc)) + 1)
    nll = nll_alone(model, params, pieces, T + 1)
    assert got == pytest.approx(sum(x.sum() for x in nll) / sum(x.size for x in nll), rel=2e-6)


def test_packed_batch_loss_is_its_documents_run_apart(rng):
    """A row packed from several documents trains on what each document would give alone:
    the train step's loss equals the mean over the documents' own next-token losses, each
    run as its own sequence from position 0 (RoPE: positions matter too)."""
    mcfg, model, tx, schedule = tiny_step_setup("model.position=rope")
    T, rows = 32, []
    for _ in range(4):
        cuts = np.sort(rng.choice(np.arange(2, T - 1), size=3, replace=False))
        rows.append(np.split(rng.integers(0, mcfg.vocab_size, T + 1), cuts))  # 4 documents
    doc = [np.repeat(np.arange(len(r)), [len(d) for d in r]) for r in rows]  # [T + 1] each
    start = [np.concatenate([[0], np.cumsum([len(d) for d in r])[:-1]]) for r in rows]
    tokens = np.stack([np.concatenate(r) for r in rows]).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": np.stack([d[:-1] + 1 for d in doc]).astype(np.int32),
             "positions": np.stack([np.arange(T) - s[d[:-1]] for d, s in zip(doc, start)]
                                   ).astype(np.int32),
             "loss_mask": np.stack([d[1:] == d[:-1] for d in doc]).astype(np.float32)}
    state = init_state(model, tx, int(rng.integers(1 << 30)))
    nll = nll_alone(model, jax.device_get(state.params), [d for r in rows for d in r], T + 1)
    _, m = make_train_step(model, tx, schedule)(state, batch)
    want = sum(x.sum() for x in nll) / sum(x.size for x in nll)
    np.testing.assert_allclose(float(m["loss"]), want, rtol=2e-6)


def test_dropout_mask_changes_with_the_step_and_repeats_for_the_same_step(rng):
    """The step's dropout draws depend on (state.rng, step) alone: the same step on the same
    state gives the same loss, another step number another mask (so another loss), and
    the loss differs from the deterministic one."""
    mcfg, model, tx, schedule = tiny_step_setup("model.dropout=0.2")
    batch = random_batch(rng, mcfg.vocab_size, 4)
    step = make_train_step(model, tx, schedule)
    state = jax.device_get(init_state(model, tx, int(rng.integers(1 << 30))))

    def loss_at(k):  # a fresh copy each time: the step donates its input
        fresh = jax.tree.map(jnp.asarray, state).replace(step=jnp.int32(k))
        return float(step(fresh, batch)[1]["loss"])

    losses = [loss_at(k) for k in (0, 1, 2, 1)]
    plain = np_nll(jax.jit(model.apply)({"params": state.params}, batch["inputs"]),
                   batch["targets"]).mean()
    assert losses[1] == losses[3]
    assert len({*losses[:3], round(float(plain), 7)}) == 4, (losses, plain)


def test_grad_norm_and_lr_metrics_are_the_true_values(rng):
    """grad_norm is the global norm of the mean-loss gradient before clipping (a huge one is
    reported as it is); lr is the schedule at the step's own index."""
    mcfg, model, tx, schedule = tiny_step_setup("optim.clip_norm=0.01", "optim.warmup_steps=3")
    batch = random_batch(rng, mcfg.vocab_size, 4, keep=0.7)
    state = init_state(model, tx, int(rng.integers(1 << 30)))
    step = make_train_step(model, tx, schedule)

    @jax.jit
    @jax.grad
    def mean_loss_grad(p):
        logp = jax.nn.log_softmax(model.apply({"params": p}, batch["inputs"]))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * batch["loss_mask"]) / batch["loss_mask"].sum()

    for k in range(3):
        grads = mean_loss_grad(jax.device_get(state.params))
        state, m = step(state, batch)
        np.testing.assert_allclose(float(m["grad_norm"]), np_global_norm(grads), rtol=1e-4)
        assert float(m["grad_norm"]) > 0.01  # so clipping had work to do
        np.testing.assert_allclose(float(m["lr"]), 3e-3 * k / 3, rtol=1e-6)  # linear warmup


def test_grad_accumulation_equals_full_batch(rng):
    cfg = load_config(str(REPO / "configs/tiny.yaml"), TINY).model
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 10)
    batch = random_batch(rng, cfg.vocab_size, 8, keep=0.8)  # uneven counts per micro-batch
    full, m_full = make_train_step(model, tx, schedule)(init_state(model, tx, 0), batch)
    acc, m_acc = make_train_step(model, tx, schedule, grad_accum=4)(init_state(model, tx, 0),
                                                                    batch)
    np.testing.assert_allclose(m_acc["loss"], m_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_acc["grad_norm"], m_full["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 acc.params, full.params)


def test_rerun_resume_never_and_best_across_resumes(corpus, tmp_path):
    from jaxformer.training.checkpoint import Checkpointer
    run = tmp_path / "run"
    train(config(corpus, run, "train.steps=4", "train.eval_every=2", "checkpoint.every=2",
                 "train.sample_tokens=0"), log=lambda *a: None)
    again = train(config(corpus, run, "train.steps=4", "train.eval_every=2",
                         "checkpoint.every=2", "train.sample_tokens=0"), log=lambda *a: None)
    assert again["start_step"] == again["step"] == 4  # a finished run: nothing to redo
    with pytest.raises(ConfigError, match="already holds checkpoints.*train.resume=auto"):
        train(config(corpus, run, "train.steps=4", "train.resume=never"), log=lambda *a: None)
    vals = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]
    ckpt = Checkpointer(run, keep=2)
    assert ckpt.best_val_loss() == pytest.approx(min(vals))
    ckpt.close()
