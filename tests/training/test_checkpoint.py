"""Checkpoints you can trust: damage is found by checksums and passed over, async saves
hold what sync ones do, and one run owns a run dir. Faults are met where a user meets
them: train.py's and generate's main (exit code, messages), run in this process."""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxformer.convert.__main__ import main as convert_main
from jaxformer.generate import main as generate_main
from jaxformer.training.saved_run import load_run, load_run_params
from jaxformer.training import train
from jaxformer.training.checkpoint import (MANIFEST, Checkpointer, CheckpointError, damage, seal,
                                           write_manifest)
from jaxformer.training.lock import run_dir_lock
from jaxformer.training.metrics import read_metrics
from tests.conftest import REPO
from tests.training.test_loop import TINY, config, corpus, restored_state  # noqa: F401 (fixture)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

# the module (the package's attribute jaxformer.generate is the decoding function)
generate_module = importlib.import_module("jaxformer.generate")

_spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

RUN = ["train.steps=9", "checkpoint.every=3", "train.eval_every=3", "train.sample_tokens=0"]


@pytest.fixture(scope="module")
def run9(corpus, tmp_path_factory):  # noqa: F811
    """A run trained to step 9 with asynchronous saves: checkpoints 6 and 9, best/."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(config(corpus, run, *RUN), log=lambda *a: None)
    return run


def copy_of(run9, tmp_path):
    shutil.copytree(run9, tmp_path / "run")
    return tmp_path / "run"


def cli_args(corpus, run, *extra):  # noqa: F811
    return [*TINY, f"data.path={corpus}", f"train.run_dir={run}",
            f"data.cache_dir={run.parent / 'cache'}", *RUN, *extra]


def largest_state_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def flip_bits(step_dir):
    """Three bits flipped in the middle of the largest file of the saved state."""
    path = largest_state_file(step_dir)
    data = bytearray(path.read_bytes())
    for i in rng.integers(len(data) // 4, 3 * len(data) // 4, 3):
        data[i] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(data))


def truncate(step_dir):
    path = largest_state_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def lose_manifest(step_dir):
    (step_dir / MANIFEST).unlink()


def lose_a_file(step_dir):
    min((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=str).unlink()


def garble_metadata(step_dir):
    (step_dir / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"state": ')


def garble_manifest(step_dir):
    (step_dir / MANIFEST).write_text('{"state/x": [1, ')


HARMS = {flip_bits: "does not match its checksum", truncate: "bytes where",
         lose_manifest: f"{MANIFEST} is missing", lose_a_file: "is missing",
         garble_metadata: "_CHECKPOINT_METADATA is unreadable",
         garble_manifest: f"{MANIFEST} is unreadable"}


def test_damage_names_each_fault_and_passes_intact_steps(run9, tmp_path):
    for step_dir in [*run9.glob("checkpoints/*"), *run9.glob("best/*")]:
        assert damage(step_dir) is None, step_dir  # every save recorded its checksums
    for harm, words in HARMS.items():
        step_dir = tmp_path / harm.__name__
        shutil.copytree(run9 / "checkpoints/9", step_dir)
        harm(step_dir)
        assert words in (damage(step_dir) or ""), (harm.__name__, damage(step_dir))


def test_seal_records_checksums_only_for_steps_without_them(run9, tmp_path):
    run = copy_of(run9, tmp_path)
    lose_manifest(run / "checkpoints/9")
    truncate(run / "checkpoints/6")  # has its checksums: stays damaged
    assert "seal RUN_DIR" in damage(run / "checkpoints/9")
    assert seal(run) == [run / "checkpoints/9"]
    assert damage(run / "checkpoints/9") is None and "bytes where" in damage(run / "checkpoints/6")


def test_a_damaged_best_is_set_aside_for_a_new_one(run9, tmp_path, capsys):
    run = copy_of(run9, tmp_path)
    [best] = (run / "best").iterdir()
    truncate(best)
    ckpt = Checkpointer(run, keep=2)
    assert ckpt.best_val_loss() == np.inf  # so the next evaluation saves a new best
    ckpt.close()
    assert [p.name for p in (run / "best").iterdir()] == [f"{best.name}.damaged"]
    assert "saves a new best" in capsys.readouterr().out


@pytest.mark.parametrize("harm", [flip_bits, truncate], ids=lambda f: f.__name__)
def test_damaged_latest_checkpoint_is_set_aside_and_the_one_before_resumed(
        run9, corpus, tmp_path, capsys, harm):  # noqa: F811
    run = copy_of(run9, tmp_path)
    harm(run / "checkpoints/9")
    (run / ".lock").write_text("process 999999 on a-dead-host\n")  # left by a killed run
    assert cli.main(cli_args(corpus, run, "checkpoint.keep=1")) == 0
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith(
        f"warning: checkpoint {run.absolute()}/checkpoints/9 is damaged (") and \
        warned[0].endswith("; set aside as 9.damaged; using step 6"), out
    assert HARMS[harm] in warned[0]
    assert f"resumed from {run}/checkpoints/6" in out
    assert "taking over the lock of process 999999 on a-dead-host" in out
    # 9 is kept apart, out of orbax's sight: keep=1 removed 6 when the new 9 was saved
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["9", "9.damaged"]
    # steps 7-9 ran again from checkpoint 6, and lost the same as the first time
    records = [r for r in read_metrics(run) if "loss" in r]
    first, again = records[:9], records[9:]
    assert [r["step"] for r in first] == list(range(1, 10))
    assert [r["step"] for r in again] == [7, 8, 9]
    for r in again:
        assert r["loss"] == first[r["step"] - 1]["loss"], r


def test_no_intact_checkpoint_is_one_line_that_names_the_damage(run9, corpus, tmp_path,
                                                                capsys):  # noqa: F811
    run = copy_of(run9, tmp_path)
    flip_bits(run / "checkpoints/9")
    truncate(run / "checkpoints/6")
    # a reader of runs first
    assert generate_main(["--run", str(run), "--prompt", "def", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: no intact checkpoint in {run.absolute()}/checkpoints "
                              "(damaged: 9: state/") and "; 6: state/" in err[-1], err
    assert cli.main(cli_args(corpus, run)) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no intact checkpoint in"), out.err
    assert "Traceback" not in out.err and "another" not in lines[0]
    # nothing was moved: a rerun meets the same error instead of starting over
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["6", "9"]


def test_init_from_an_unsaved_step_is_one_line(run9, corpus, tmp_path, capsys):  # noqa: F811
    new = tmp_path / "new"
    assert cli.main(cli_args(corpus, new, f"train.init_from={run9}@99")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: train.init_from={run9}@99: no checkpoint "
                                f"{run9}/checkpoints/99; saved steps: [6, 9]"], err
    assert not (new / "config.yaml").exists()


def test_a_save_killed_half_way_is_ignored_and_cleaned_up(run9, corpus, tmp_path,
                                                           capsys):  # noqa: F811
    """What SIGKILL during an async save leaves: orbax's temporary directory, half
    written, never renamed to its step."""
    run = copy_of(run9, tmp_path)
    half = run / "checkpoints/12.orbax-checkpoint-tmp"
    shutil.copytree(run / "checkpoints/9", half)
    lose_manifest(half)
    truncate(half)
    assert cli.main(cli_args(corpus, run, "train.steps=12")) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run}/checkpoints/9" in out and "warning" not in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "9"]
    assert damage(run / "checkpoints/12") is None


def test_a_second_run_on_a_busy_run_dir_stops_and_names_the_first(corpus, tmp_path,
                                                                  capsys):  # noqa: F811
    run = tmp_path / "run"
    run.mkdir()
    with run_dir_lock(run):
        assert cli.main(cli_args(corpus, run)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: {run} is in use by process {os.getpid()} on {socket.gethostname()}"), err
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # it touched nothing


def test_async_saves_hold_bitwise_what_sync_saves_hold(run9, corpus, tmp_path):  # noqa: F811
    sync = tmp_path / "sync"
    train(config(corpus, sync, *RUN, "checkpoint.async_save=false"), log=lambda *a: None)
    cfg = config(corpus, run9, *RUN)
    for step in (6, 9):
        a, b = restored_state(cfg, run9, step), restored_state(cfg, sync, step)
        leaves = jax.tree.leaves(jax.tree.map(np.array_equal, a, b))
        assert len(leaves) > 10 and all(leaves), step


def listing(run):
    """Every path under a run dir, with each file's size: what a reader must leave as is."""
    return sorted((str(p.relative_to(run)), p.stat().st_size if p.is_file() else None)
                  for p in run.rglob("*"))


def orbax_params(step_dir):
    """The params saved in a checkpoint step, read by orbax alone (no jaxformer code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # orbax: no shardings given, it reads the saved ones
        return jax.device_get(ocp.PyTreeCheckpointer().restore(step_dir / "state")["params"])


def same_params(a, b):
    equal = jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x),
                                                                     np.asarray(y)), a, b))
    return len(equal) > 10 and all(equal)


def test_readers_pass_over_a_damaged_newest_step_and_move_nothing(run9, tmp_path, capsys,
                                                                  monkeypatch):
    """generate --run, load_run / load_run_params and convert to-hf read the newest intact
    step, say on stderr which step is damaged, and rename or delete nothing: they may run
    beside a training run (here saving step 12), or on a copy the user wants kept as it
    is. A damaged step asked for by name is an error."""
    import jaxformer.convert

    run = copy_of(run9, tmp_path)
    flip_bits(run / "checkpoints/9")
    in_flight = run / "checkpoints/12.orbax-checkpoint-tmp-1767225600"  # a training's save
    shutil.copytree(run9 / "checkpoints/9", in_flight)
    lose_manifest(in_flight)  # (written last, before the rename)
    want = orbax_params(run9 / "checkpoints/6")  # from the undamaged run
    assert not same_params(want, orbax_params(run9 / "checkpoints/9"))  # so 9 would show
    before = listing(run)

    def warned_of_9(err):
        lines = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(lines) == 1 and lines[0].startswith(
            f"warning: checkpoint {run.absolute()}/checkpoints/9 is damaged (state/") and \
            lines[0].endswith(" does not match its checksum); using step 6"), err

    cfg, params = load_run_params(run)  # notebooks
    warned_of_9(capsys.readouterr().err)
    assert same_params(params, want) and listing(run) == before
    _, params, _ = load_run(str(run))
    warned_of_9(capsys.readouterr().err)
    assert same_params(params, want) and listing(run) == before

    loaded, real_load_run = [], generate_module.load_run
    monkeypatch.setattr(generate_module, "load_run",
                        lambda *a, **kw: loaded.append(real_load_run(*a, **kw)) or loaded[-1])
    assert generate_main(["--run", str(run), "--prompt", "def", "--max-new-tokens", "2"]) == 0
    warned_of_9(capsys.readouterr().err)
    assert len(loaded) == 1 and same_params(loaded[0][1], want) and listing(run) == before
    # int8 weights and a prompt-lookup draft from the command line
    assert generate_main(["--run", str(run), "--prompt", "def", "--max-new-tokens", "3",
                          "--weights", "int8", "--draft", "prompt_lookup", "--draft-len", "2"]) == 0
    assert "draft acceptance rate: " in capsys.readouterr().err
    # a constraint from the command line: beams that repeat no token (the prompt's included)
    assert generate_main(["--run", str(run), "--prompt", "etaoin shrdlu", "--max-new-tokens",
                          "6", "--beam-width", "2", "--no-repeat-ngram-size", "1"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert text.startswith("etaoin shrdlu") and len(set(text)) == len(text), text

    handed = []  # the converter gets the params to-hf loaded (recorded, not written)
    monkeypatch.setattr(jaxformer.convert, "to_hf", lambda cfg, params, hf_dir, **kw: (
        handed.append(params) or {"architectures": ["Recorded"]}))
    assert convert_main(["to-hf", str(run), str(tmp_path / "hf")]) == 0
    warned_of_9(capsys.readouterr().err)
    assert len(handed) == 1 and same_params(handed[0], want) and listing(run) == before

    named = (rf"no intact checkpoint in {re.escape(str(run.absolute()))}/checkpoints "
             r"\(damaged: 9: state/\S+ does not match its checksum\)")
    with pytest.raises(CheckpointError, match=named):
        load_run_params(run, step=9)
    assert convert_main(["to-hf", str(run / "checkpoints/9"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(f"error: {named}", err[0]), err
    assert len(handed) == 1  # the damaged step named reached no converter
    assert listing(run) == before


def test_the_checksum_covers_a_file_past_its_first_read_chunk(tmp_path):
    """crc32 reads 16 MiB (1 << 24 bytes) at a time: a byte flipped past the first chunk of
    a larger file is found. Reference: zlib.crc32 of the whole file."""
    step = tmp_path / "7"
    (step / "state").mkdir(parents=True)
    (step / "model").mkdir()
    (step / "model/metadata").write_text('{"d_model": 32}')
    data = bytearray(rng.bytes((1 << 24) + int(rng.integers(1, 1 << 20))))
    (step / "state/big").write_bytes(data)
    write_manifest(step)
    recorded = json.loads((step / MANIFEST).read_text())
    assert recorded["state/big"] == [len(data), zlib.crc32(data)]
    assert damage(step) is None
    i = int(rng.integers(1 << 24, len(data)))
    data[i] ^= 1 << int(rng.integers(8))
    (step / "state/big").write_bytes(data)
    assert damage(step) == "state/big does not match its checksum", i


def test_taking_over_a_dead_holders_lock_names_the_new_holder(tmp_path):
    """A process killed while it held the lock leaves its name in RUN_DIR/.lock; the next
    run takes the lock over, names the dead holder, and the file then names this process
    alone."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import importlib.util, os, pathlib, signal, sys
        spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
        lock = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lock)
        with lock.run_dir_lock(pathlib.Path(sys.argv[2])):
            os.kill(os.getpid(), signal.SIGKILL)
        """), str(REPO / "jaxformer/training/lock.py"), str(run)])
    assert holder.wait(timeout=60) == -signal.SIGKILL
    host = socket.gethostname()
    assert (run / ".lock").read_text() == f"process {holder.pid} on {host}\n"  # left behind
    said = []
    with run_dir_lock(run, log=said.append):
        held = (run / ".lock").read_text()
    assert said == [f"{run}: taking over the lock of process {holder.pid} on {host}, which "
                    "is no longer running"]
    assert held == f"process {os.getpid()} on {socket.gethostname()}\n"
    assert (run / ".lock").read_text() == ""  # emptied at a clean exit


def test_a_worse_evaluation_after_a_resume_leaves_the_best(run9, corpus, tmp_path):  # noqa: F811
    """best/ holds the lowest validation loss of the whole run, across resumes: resumed at
    step 9 with a learning rate far too high, the evaluation at step 12 is worse than the
    best before the resume, and best/ keeps that one."""
    run = copy_of(run9, tmp_path)
    vals = {r["step"]: r["val_loss"] for r in read_metrics(run) if "val_loss" in r}
    best = min(vals, key=vals.get)
    assert [p.name for p in (run / "best").iterdir()] == [str(best)]
    summary = train(config(corpus, run, *RUN, "train.steps=12", "optim.lr=10"),
                    log=lambda *a: None)
    assert summary["start_step"] == 9
    after = [r for r in read_metrics(run) if "val_loss" in r][len(vals):]
    assert [r["step"] for r in after] == [12] and after[0]["val_loss"] > vals[best], after
    assert [p.name for p in (run / "best").iterdir()] == [str(best)]
    saved = json.loads((run / "best" / str(best) / "info/metadata").read_text())
    assert saved == {"step": best, "val_loss": vals[best]}
    assert damage(run / "best" / str(best)) is None


def test_a_config_saved_before_a_field_existed_compares_as_its_default():
    """A checkpoint's model config written before a field was added lacks that field (and
    nested ones: a lora key): it restores under the default, and only under the default."""
    from jaxformer.model.config import ModelConfig
    from jaxformer.training.checkpoint import config_diff
    cfg = ModelConfig(vocab_size=int(rng.integers(32, 300)), d_model=32, n_layers=2, n_heads=4)
    saved = cfg.to_dict()
    default = ModelConfig().to_dict()  # a new field comes with its default (not derived)
    alike = sorted(k for k in saved if k != "lora" and saved[k] == default[k])
    gone = [str(k) for k in rng.permutation(alike)[:3]] + ["arch"]
    old = {k: v for k, v in saved.items() if k not in gone}
    old["lora"] = {k: v for k, v in saved["lora"].items() if k != "rank"}
    assert config_diff(old, cfg.to_dict()) == []
    old.pop("arch", None)
    assert config_diff(old, cfg.replace(arch="encoder").to_dict()) == [
        "arch: 'decoder' -> 'encoder'"]
    changed = cfg.replace(lora=cfg.lora.replace(rank=4)).to_dict()
    assert config_diff(old, changed) and "rank" in config_diff(old, changed)[0]


def test_a_config_saved_with_a_schemes_flat_keys_compares_as_its_settings():
    """A checkpoint's model config written when a scheme's settings were flat model fields
    (t5_num_buckets, sinusoidal_scale, ...) compares equal to today's config of the same
    model (those settings under position_settings), and unequal to another setting."""
    from jaxformer.model.config import ModelConfig
    from jaxformer.training.checkpoint import config_diff
    buckets, distance = int(rng.integers(4, 40)), int(rng.integers(41, 300))
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, position="t5",
                      position_settings={"num_buckets": buckets, "max_distance": distance})
    old = {k: v for k, v in cfg.to_dict().items() if k != "position_settings"}
    old |= {"t5_num_buckets": buckets, "t5_max_distance": distance, "cope_positions": 64,
            "sinusoidal_scale": "table"}  # a full dump of before: every scheme's keys
    assert config_diff(old, cfg.to_dict()) == []
    other = cfg.replace(position_settings={"num_buckets": buckets + 1, "max_distance": distance})
    assert config_diff(old, other.to_dict()) and "num_buckets" in " ".join(
        config_diff(old, other.to_dict()))


def test_a_mixers_runtime_setting_restores_and_its_others_are_refused():
    """A hybrid model's mixer settings compare one by one: its chunk length (the mixers'
    RUNTIME, in model.COMPUTE_ONLY) is a compute setting a checkpoint restores under, named
    mixer.NAME.chunk; any other setting of it is another model; a default written out
    equals one left unwritten (a config saved without model.mixer)."""
    from jaxformer.model.config import COMPUTE_ONLY, ModelConfig
    from jaxformer.training.checkpoint import config_diff
    kinds = {"d": {"mixer": "gated_delta"}, "m": {"mixer": "mamba2"}, "a": {}}
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, position="none",
                      layer_pattern=["d", "m", "a"], layer_kinds=kinds)
    saved = cfg.to_dict()
    assert saved["mixer"] is None  # nothing written: every mixer at its defaults
    chunk = int(rng.integers(1, 60))
    chunked = cfg.replace(mixer={"gated_delta": {"chunk": chunk}, "mamba2": {}})
    assert config_diff(saved, chunked.to_dict(), skip=COMPUTE_ONLY) == []
    assert config_diff(saved, chunked.to_dict()) == [f"mixer.gated_delta.chunk: 64 -> {chunk}"]
    written = cfg.replace(mixer={"gated_delta": {}, "mamba2": {}}).to_dict()
    assert written["mixer"] and config_diff(saved, written) == []
    wider = cfg.replace(mixer={"mamba2": {"heads": 4}})
    assert config_diff(saved, wider.to_dict(), skip=COMPUTE_ONLY) == [
        "mixer.mamba2.heads: 8 -> 4"]
