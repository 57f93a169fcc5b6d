"""train.profile=START:STOP (jaxformer.training.profiling): a run writes an XProf trace of
those steps into its run dir; a bad value is refused in one line naming the setting."""

import dataclasses

import pytest

from jaxformer.core.validation import ConfigError
from jaxformer.training import load_config, train
from tests.conftest import REPO

TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16",
        "train.seq_len=16", "train.batch_size=2", "train.steps=3", "train.eval_every=100",
        "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
        "checkpoint.every=100", "checkpoint.async_save=false"]


def test_a_profiled_run_writes_a_trace_into_its_run_dir(tmp_path):
    """A 3-step run with train.profile=1:2 leaves one .xplane.pb under RUN/profile."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"def f{i}(x): return x + {i}" for i in range(400)))
    run = tmp_path / "run"
    cfg = load_config(str(REPO / "configs/tiny.yaml"),
                      [*TINY, f"data.path={corpus}", f"train.run_dir={run}",
                       f"data.cache_dir={tmp_path / 'cache'}", "train.profile=1:2"])
    train(cfg, log=lambda *a, **k: None)
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
    said = []  # resumed past the window: said, and nothing more traced
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4)), log=said.append)
    assert "train.profile=1:2: this run starts at step 3, past it; nothing is traced (choose " \
        "a window after 3)" in said, said
    assert list((run / "profile").rglob("*.xplane.pb")) == traces


@pytest.mark.parametrize("value", ["3:1", "x", "2:2", "1:2:3"])
def test_a_bad_profile_is_refused_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.profile={value}"])
    text = str(err.value)
    assert text.startswith(f"train.profile={value!r}") and "START:STOP" in text
    assert "\n" not in text


@pytest.mark.parametrize("value", ["3:5", "7:9"])
def test_a_window_from_train_steps_on_is_refused(value):
    """train.steps=3 runs steps 0, 1, 2: a window starting at 3 or later traces nothing."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=3", f"train.profile={value}"])
    assert str(err.value) == (f"train.profile={value} starts at step {value.split(':')[0]}, not "
                              "before train.steps=3: no step of it would run; choose START "
                              "below 3")
    assert load_config(None, ["train.steps=3", "train.profile=2:9"]).train.profile == "2:9"
