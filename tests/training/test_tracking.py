"""W&B tracking (train.wandb): an offline W&B run holds metrics.jsonl's records at their
steps and the resolved config, a resumed run continues the same W&B run, and without the
wandb package the run stops at once with one line naming the extra, and a run that raises
marks its W&B run failed (exit code 1; a fake wandb module records it). The W&B files are
read by wandb's own transaction-log reader (`wandb leet inspect --json`)."""

import importlib.machinery
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, loop, tracking, train
from jaxformer.training.metrics import read_metrics
from tests.conftest import REPO
from tests.training.test_loop import config, corpus  # noqa: F401 (a fixture)

RUN = ["train.sample_tokens=0", "train.eval_every=2", "checkpoint.every=2",
       "train.wandb=jaxformer-test", "model.n_layers=1"]  # one layer: fewer ops to compile


@pytest.fixture(scope="module")
def resumed(corpus, tmp_path_factory):  # noqa: F811
    """A run dir trained to step 4, then resumed to step 6, with W&B offline; (run dir,
    each session's config, each session's offline W&B run dir)."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    sessions, dirs = [], []
    for steps in (4, 6):
        cfg = config(corpus, run, f"train.steps={steps}", *RUN)
        train(cfg, log=lambda *a: None)
        sessions.append(cfg)
        (new,) = set((run / "wandb").glob("offline-run-*")) - set(dirs)  # one per session
        dirs.append(new)
    return run, sessions, dirs


def wandb_records(offline_dir):
    """The records of an offline run's .wandb file, as wandb's reader gives them."""
    (log,) = offline_dir.glob("run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, check=True).stdout
    return log, [json.loads(line) for line in out.splitlines() if line.strip()]


def history(records):
    """{step: the metrics logged at it} (W&B's step, and W&B's own keys dropped)."""
    rows = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            rows[r["history"]["step"]["num"]] = {k: v for k, v in item.items()
                                                 if not k.startswith("_")}
    return rows


def run_record(records):
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def expected(run_dir, steps):
    """metrics.jsonl's records at `steps`, merged per step (a step's train and eval records
    are one W&B row)."""
    rows = {}
    for r in read_metrics(run_dir):
        if r["step"] in steps:
            rows.setdefault(r["step"], {}).update(r)
    return rows


def test_offline_run_holds_the_metrics_and_the_config(resumed):
    run, (cfg, _), (first, _) = resumed
    log, records = wandb_records(first)
    assert log.name == f"run-{(run / 'wandb_id').read_text().strip()}.wandb"
    rows = history(records)
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows == expected(run, range(1, 5))  # loss, lr, ..., val_loss: the same floats
    assert {"loss", "val_loss", "lr", "grad_norm"} <= set(rows[4])
    logged = {k: v for k, v in run_record(records)["config"]["update"].items() if k != "_wandb"}
    assert logged == json.loads(json.dumps(cfg.to_dict()))
    assert run_record(records)["project"] == "jaxformer-test"


def test_resumed_run_continues_the_same_wandb_run(resumed):
    run, (_, cfg), (first, second) = resumed
    run_id = (run / "wandb_id").read_text().strip()
    (log1, records1), (log2, records2) = wandb_records(first), wandb_records(second)
    assert log1.name == log2.name == f"run-{run_id}.wandb"
    assert run_record(records1)["run_id"] == run_record(records2)["run_id"] == run_id
    assert run_record(records2).get("resume") is True
    rows = history(records2)
    assert sorted(rows) == [5, 6]  # after the checkpoint at step 4, where the first stopped
    assert rows == expected(run, (5, 6))
    assert run_record(records2)["config"]["update"]["train"]["steps"] == cfg.train.steps == 6
    exits = [r["exit"]["exit_code"] for r in records1 + records2 if r["type"] == "exit"]
    assert exits == [0, 0]


def test_without_wandb_one_line_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails; no spec found
    run = tmp_path / "run"
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"train.run_dir={run}",
                                                        "train.wandb=p"])
    for attempt in (lambda: train(cfg, log=lambda *a: None), lambda: tracking.start(cfg, run)):
        with pytest.raises(ConfigError) as e:
            attempt()
        assert "\n" not in str(e.value)
        assert "train.wandb=p" in str(e.value) and "pip install 'jaxformer[wandb]'" in str(e.value)
    assert not run.exists()  # refused before any work
    # without train.wandb, or on a process other than the lead, nothing needs wandb
    tracking.check(cfg.train, lead=False)
    assert tracking.start(cfg, run, lead=False) is None
    plain = load_config(str(REPO / "configs/tiny.yaml"), [f"train.run_dir={run}"])
    tracking.check(plain.train)
    assert tracking.start(plain, run) is None and not run.exists()


@pytest.mark.parametrize("override, words", [
    ("train.wandb_mode=cloud", "train.wandb_mode='cloud' is not one of offline, online"),
    ("train.wandb=team/proj", "train.wandb='team/proj' must be a W&B project name"),
])
def test_bad_wandb_settings_are_one_line(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert words in str(e.value) and "\n" not in str(e.value)


class FakeRun:
    """What Tracker needs of a wandb Run: the next step (a resumed online run's is past the
    steps it holds) and log(); records the calls."""

    def __init__(self, step):
        self.step, self.logged = step, []

    def log(self, data, step):
        self.logged.append((step, data))


def test_tracker_flattens_lists_and_skips_steps_the_run_holds(rng):
    losses = rng.normal(size=3).tolist()
    run = FakeRun(step=5)  # resumed after step 4 was logged
    tracker = tracking.Tracker(run)
    tracker.log({"step": 4, "loss": 1.0})  # again after the resume: W&B refuses it
    tracker.log({"step": 5, "loss": float(np.mean(losses)), "losses": losses})
    assert run.logged == [(5, {"step": 5, "loss": float(np.mean(losses)),
                               **{f"losses/{i}": x for i, x in enumerate(losses)}})]


class RecordingRun(FakeRun):
    """A wandb Run that records finish()'s exit code (None: finish() without one)."""

    id = "recorded"

    def __init__(self):
        super().__init__(step=0)
        self.exit_codes = []

    def finish(self, exit_code=None, **kwargs):
        self.exit_codes.append(exit_code)


@pytest.fixture
def fake_wandb(monkeypatch):
    """A wandb module whose init() returns a RecordingRun; the runs it made, in order."""
    runs = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec finds it
    module.init = lambda **kwargs: runs.append(RecordingRun()) or runs[-1]
    module.Settings = lambda **kwargs: kwargs
    module.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_a_failed_run_marks_its_wandb_run_failed(corpus, tmp_path, fake_wandb,  # noqa: F811
                                                 monkeypatch, rng):
    """An exception raised inside training (reading step k's batch) reaches the caller,
    and the W&B run finishes with exit code 1; runs that end normally finish with 0, also
    one started while the caller handles an exception of its own."""
    steps, bad = 2, int(rng.integers(0, 2))
    train(config(corpus, tmp_path / "ok", f"train.steps={steps}", *RUN), log=lambda *a: None)
    read = loop._Run.batch_at

    def failing(self, step):
        if step == bad:
            raise RuntimeError("the data went away")
        return read(self, step)
    with monkeypatch.context() as m:
        m.setattr(loop._Run, "batch_at", failing)
        with pytest.raises(RuntimeError, match="the data went away"):
            train(config(corpus, tmp_path / "bad", f"train.steps={steps}", *RUN),
                  log=lambda *a: None)
    try:
        raise KeyError("the caller's own")
    except KeyError:
        train(config(corpus, tmp_path / "inside", f"train.steps={steps}", *RUN),
              log=lambda *a: None)
    assert [r.exit_codes for r in fake_wandb] == [[0], [1], [0]]
