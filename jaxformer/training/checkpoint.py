"""Checkpoints with orbax: the last `keep` under checkpoints/, the best by validation loss
under best/, each holding the train state and the model config it was made with.

Orbax writes a step into a temporary directory and renames it when complete, so a save
killed half-way leaves nothing that `latest_step` would pick up. Saves are asynchronous:
the step loop goes on while the files are written, and the next save (or `wait`) first
completes the one in flight.

Before that rename, `checksums.json` records the size and CRC-32 of every file the step
wrote. A restore checks them before it reads a value; a step whose files do not match is
damaged. Resuming skips damaged steps, newest first, and sets each aside as STEP.damaged,
which orbax neither restores nor deletes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import zlib

import jax
import orbax.checkpoint as ocp
import yaml

from jaxformer.model.config import COMPUTE_ONLY, ConfigError, ModelConfig
from jaxformer.model.mixers import setting_fields

MANIFEST = "checksums.json"


class CheckpointError(RuntimeError):
    """No checkpoint that was asked for (or none at all) is intact."""


def with_defaults(saved: dict, defaults: dict) -> dict:
    """saved, with each field it lacks (made before the field existed) at its default."""
    return {**defaults, **{k: with_defaults(v, defaults[k]) if isinstance(v, dict) and
                           isinstance(defaults.get(k), dict) else v for k, v in saved.items()}}


def config_diff(saved: dict, current: dict, skip=()) -> list[str]:
    """'field: saved -> current' for every model field that differs (but those in skip); a
    field the saved config lacks (it predates the field) counts as ModelConfig's default,
    and the saved config is read as ModelConfig reads it today (a scheme's flat keys of
    before: its position_settings), so a run written before a field moved compares as the
    same. Mixers' settings compare one by one (mixers.setting_fields: mixer.NAME.KEY)."""
    saved = with_defaults(saved, ModelConfig().to_dict())
    try:
        saved, current = (setting_fields(ModelConfig.from_dict(c)) for c in (saved, current))
    except ConfigError:  # a config this version refuses: compared as it was written
        pass
    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k) != current.get(k) and k not in skip]


def crc32(path: pathlib.Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def file_checksums(step_dir: pathlib.Path) -> dict[str, list[int]]:
    """{path: [bytes, crc32]} of every file in the step's item directories (state/,
    model/, info/). The files at the top (orbax's step metadata, this manifest) are
    written or updated after the checksums; they are checked by being parsed."""
    return {str(p.relative_to(step_dir)): [p.stat().st_size, crc32(p)]
            for p in sorted(step_dir.rglob("*")) if p.is_file() and p.parent != step_dir}


def write_manifest(step_dir: pathlib.Path):
    tmp = step_dir / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(file_checksums(step_dir)))
    os.replace(tmp, step_dir / MANIFEST)


def damage(step_dir: pathlib.Path, *, contents: bool = True) -> str | None:
    """What is wrong with a checkpoint step directory, or None when every file it
    recorded is there with the size and checksum it was written with (contents=False:
    the sizes only, which reads no file's bytes)."""
    try:
        recorded = json.loads((step_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return (f"{MANIFEST} is missing: a partial copy, or saved before checksums existed "
                "(if so and you trust it: python -m jaxformer.training.checkpoint seal RUN_DIR)")
    except (ValueError, UnicodeDecodeError):
        recorded = None
    if not isinstance(recorded, dict) or not recorded or not all(
            isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
            for v in recorded.values()):
        return f"{MANIFEST} is unreadable"
    for name, (size, crc) in recorded.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes where {size} were written"
        if contents and crc32(path) != crc:
            return f"{name} does not match its checksum"
    metadata = step_dir / "_CHECKPOINT_METADATA"
    try:
        json.loads(metadata.read_text())
    except FileNotFoundError:
        pass
    except (ValueError, UnicodeDecodeError):
        return f"{metadata.name} is unreadable"
    return None


def newest_intact_step(directory, *, contents: bool = True) -> int | None:
    """The newest step under `directory` (a run's checkpoints/ or best/) that `damage`
    finds nothing wrong with, or None. A save still in orbax's temporary directory is no
    step yet; one renamed but not yet sealed with its checksums is skipped."""
    directory = pathlib.Path(directory)
    steps = [int(p.name) for p in directory.glob("*") if p.name.isdigit() and p.is_dir()]
    for step in sorted(steps, reverse=True):
        if damage(directory / str(step), contents=contents) is None:
            return step
    return None


class Checkpointer:
    def __init__(self, run_dir: str | pathlib.Path, *, keep: int, async_save: bool = True,
                 log=print, read_only: bool = False):
        """read_only: for a reader of the run (generate, convert), which may run beside its
        training: the half-written saves it finds are left to that run, not cleaned up."""
        self.run_dir = run_dir = pathlib.Path(run_dir).absolute()
        self.async_save, self.log = async_save, log
        self.record: dict = {}  # more keys for every save's info item (its step, val_loss)
        self.latest = self._manager(run_dir / "checkpoints", keep, read_only)
        self.best = self._manager(run_dir / "best", 1, read_only)

    @staticmethod
    def _manager(directory: pathlib.Path, max_to_keep: int, read_only: bool):
        saving = {}  # the step in flight: one at a time per manager

        def record_checksums():  # in orbax's commit thread, before the rename to the step
            step = saving["step"]
            tmp = list(directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            write_manifest(tmp[0] if len(tmp) == 1 else directory / str(step))

        # each manager's barriers carry its directory's name: the saves of one step under
        # checkpoints/ and best/ run at once, and on several processes the second one's
        # barrier was refused as already ongoing ("_async_write_complete.STEP")
        processes = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=directory.name)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=record_checksums),
            multiprocessing_options=processes, cleanup_tmp_directories=not read_only,
            create=True)
        mngr = ocp.CheckpointManager(directory, options=options,
                                     item_names=("state", "model", "info"))
        mngr.saving = saving
        return mngr

    def save(self, step: int, state, model_cfg: ModelConfig, *, val_loss: float | None = None,
             best: bool = False):
        """Save under checkpoints/ (or, with best=True, as the one under best/). A step that
        is already saved there is left as it is: the state at a step is always the same.
        The save runs in the background unless async_save=False."""
        mngr = self.best if best else self.latest
        if step in mngr.all_steps():
            return
        mngr.wait_until_finished()  # the previous save is sealed before `saving` moves on
        mngr.saving["step"] = step
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  model=ocp.args.JsonSave(model_cfg.to_dict()),
                                  info=ocp.args.JsonSave({"step": step, "val_loss": val_loss,
                                                          **self.record}))
        mngr.save(step, args=args, force=True)
        if not self.async_save:
            mngr.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def best_val_loss(self) -> float:
        """The validation loss of the checkpoint under best/ (inf when there is none or it
        is damaged: then it is set aside, and the next evaluation saves a new best)."""
        step, problems = self._newest_intact(self.best, None, set_aside=True)
        if step is None:
            self._report(self.best, problems, True, "the next evaluation saves a new best")
            return math.inf
        value = self.saved_info(step, best=True).get("val_loss")
        return math.inf if value is None else float(value)

    def saved_info(self, step: int, *, best: bool = False) -> dict:
        """The info item saved with a step: its step, val_loss and `record`."""
        mngr = self.best if best else self.latest
        return mngr.restore(step, args=ocp.args.Composite(info=ocp.args.JsonRestore()))["info"]

    def _newest_intact(self, mngr, step, *, set_aside: bool) -> tuple[int | None, list]:
        """(the newest intact step, or `step` if it is intact, or None; [(step, damage)] of
        the newer ones). When an intact one is found, each damaged one is reported in a
        line, and set aside if asked. (When none is, nothing moves and nothing is said
        here: the caller's error names the damage, and a rerun meets it again instead of
        quietly starting over.)"""
        problems = []
        for s in [step] if step is not None else sorted(mngr.all_steps(), reverse=True):
            problem = damage(pathlib.Path(mngr.directory) / str(s))
            if problem is None:
                self._report(mngr, problems, set_aside, f"using step {s}")
                return s, problems
            problems.append((s, problem))
        return None, problems

    def _report(self, mngr, problems, set_aside: bool, then: str):
        """One warning line per damaged step; with set_aside, process 0 renames each
        STEP.damaged, out of orbax's sight (neither restored nor deleted by `keep`)."""
        for s, problem in problems:
            path, moved = pathlib.Path(mngr.directory) / str(s), ""
            if set_aside and jax.process_index() == 0:
                path.rename(aside := _free_name(path))
                moved = f"; set aside as {aside.name}"
            self.log(f"warning: checkpoint {path} is damaged ({problem}){moved}; {then}")
        if set_aside and problems:
            mngr.reload()

    def restore(self, abstract_state, model_cfg: ModelConfig, *, step: int | None = None,
                best: bool = False, set_aside: bool = False, settings: dict | None = None):
        """The state saved at `step`, or else in the newest intact checkpoint, after checking
        its files against their checksums and its model config against `model_cfg`.
        Damaged checkpoints are skipped with a warning (and renamed STEP.damaged when
        set_aside, as resuming does). abstract_state: jax.eval_shape of a fresh state;
        settings: the resuming run's whole config, whose optimizer and objective a state of
        another shape is compared with the run dir's config.yaml's."""
        mngr = self.best if best else self.latest
        if step is None and mngr.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
        if step is not None and step not in mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint {mngr.directory}/{step}; saved steps: "
                                    f"{sorted(mngr.all_steps())}")
        step, problems = self._newest_intact(mngr, step, set_aside=set_aside)
        if step is None:
            damaged = "; ".join(f"{s}: {p}" for s, p in problems)
            raise CheckpointError(f"no intact checkpoint in {mngr.directory} (damaged: "
                                  f"{damaged}); nothing was restored or moved. Resume from a "
                                  "copy of the run dir, or start a new train.run_dir")
        saved = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
        diff = config_diff(saved, model_cfg.to_dict(), skip=COMPUTE_ONLY)
        if diff:
            raise ConfigError(f"checkpoint {mngr.directory}/{step} was made with another model "
                              f"config ({'; '.join(diff)}); restore it with the same model "
                              "settings, or use a new train.run_dir")
        if computed := config_diff(saved, model_cfg.to_dict()):
            self.log(f"checkpoint {mngr.directory}/{step} was made with other compute settings "
                     f"({'; '.join(computed)}): restored, run with this run's")
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except (ValueError, KeyError, TypeError) as e:
            changed = self.state_settings_diff(settings)
            why = (f"this run's optimizer settings differ from the run dir's config.yaml: "
                   f"{'; '.join(changed)}" if changed else
                   "were optimizer settings such as optim.clip_norm changed?")
            raise ConfigError(
                f"checkpoint {mngr.directory}/{step} holds a train state of another shape than "
                f"this run's ({why}); resume with the settings it was made with (config.yaml "
                f"in the run dir), or use a new train.run_dir"
                + ("" if changed else f". Detail: {str(e).splitlines()[0][:300]}")) from None
        return restored["state"]

    def state_settings_diff(self, settings: dict | None) -> list[str]:
        """'optim.name: saved -> current' for each optimizer and objective setting (they
        shape the train state) where `settings` differ from the run dir's config.yaml."""
        try:
            saved = yaml.safe_load((self.run_dir / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return []
        if settings is None or not isinstance(saved, dict):
            return []
        return [f"{name}.{k}: {v!r} -> {settings[name][k]!r}"
                for name in ("optim", "objective") if isinstance(saved.get(name), dict)
                for k, v in saved[name].items() if v != settings.get(name, {}).get(k, v)]

    def wait(self):
        """Complete the saves in flight."""
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self):
        self.latest.close()
        self.best.close()


def _free_name(path: pathlib.Path) -> pathlib.Path:
    """STEP.damaged, or STEP.damaged-2, ... when that is taken."""
    aside, n = path.with_name(f"{path.name}.damaged"), 2
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged-{n}"), n + 1
    return aside


def abstract_like(state):
    """ShapeDtypeStructs (with shardings) for a state, to restore into."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def seal(run_dir) -> list[pathlib.Path]:
    """Record checksums for the steps of a run dir that have none (saved before jaxformer
    wrote them), trusting their files as they are now; returns the steps sealed."""
    run_dir = pathlib.Path(run_dir)
    steps = [p for p in sorted([*run_dir.glob("checkpoints/*"), *run_dir.glob("best/*")])
             if p.name.isdigit() and p.is_dir() and not (p / MANIFEST).exists()]
    for step_dir in steps:
        write_manifest(step_dir)
    return steps


if __name__ == "__main__":  # python -m jaxformer.training.checkpoint seal RUN_DIR
    import sys
    if len(sys.argv) != 3 or sys.argv[1] != "seal":
        sys.exit("usage: python -m jaxformer.training.checkpoint seal RUN_DIR")
    for sealed in seal(sys.argv[2]):
        print(f"sealed {sealed}")
