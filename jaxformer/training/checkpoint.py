"""Checkpoints with orbax: the last `keep` under checkpoints/, the best by validation loss
under best/, each holding the train state and the model config it was made with.

Orbax writes a step into a temporary directory and renames it when complete, so a save
killed half-way leaves nothing that `latest_step` would pick up.
"""

from __future__ import annotations

import math
import pathlib

import jax
import orbax.checkpoint as ocp

from jaxformer.config import ConfigError, ModelConfig


def config_diff(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for every model field that differs."""
    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k) != current.get(k)]


class Checkpointer:
    def __init__(self, run_dir: str | pathlib.Path, *, keep: int, async_save: bool = True):
        run_dir = pathlib.Path(run_dir).absolute()

        def manager(sub, max_to_keep):
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True, create=True)
            return ocp.CheckpointManager(run_dir / sub, options=options,
                                         item_names=("state", "model", "info"))

        self.latest = manager("checkpoints", keep)
        self.best = manager("best", 1)

    def save(self, step: int, state, model_cfg: ModelConfig, *, val_loss: float | None = None,
             best: bool = False):
        """Save under checkpoints/ (or, with best=True, as the one under best/). A step that
        is already saved there is left as it is: the state at a step is always the same."""
        mngr = self.best if best else self.latest
        if step in mngr.all_steps():
            return
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  model=ocp.args.JsonSave(model_cfg.to_dict()),
                                  info=ocp.args.JsonSave({"step": step, "val_loss": val_loss}))
        mngr.save(step, args=args, force=True)

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def best_val_loss(self) -> float:
        """The validation loss of the checkpoint under best/ (inf when there is none)."""
        step = self.best.latest_step()
        if step is None:
            return math.inf
        info = self.best.restore(step, args=ocp.args.Composite(info=ocp.args.JsonRestore()))
        value = info["info"].get("val_loss")
        return math.inf if value is None else float(value)

    def restore(self, abstract_state, model_cfg: ModelConfig, *, step: int | None = None,
                best: bool = False):
        """The state saved at `step` (default: the latest), after checking that it was made
        with the same model config. abstract_state: jax.eval_shape of a fresh state."""
        mngr = self.best if best else self.latest
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
        saved = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
        diff = config_diff(saved, model_cfg.to_dict())
        if diff:
            raise ConfigError(f"checkpoint {mngr.directory}/{step} was made with another model "
                              f"config ({'; '.join(diff)}); restore it with the same model "
                              "settings, or use a new train.run_dir")
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"checkpoint {mngr.directory}/{step} holds a train state of another shape than "
                f"this run's (were optimizer settings such as optim.clip_norm changed?); resume "
                f"with the settings it was made with (config.yaml in the run dir), or use a new "
                f"train.run_dir. Detail: {str(e).splitlines()[0][:300]}") from None
        return restored["state"]

    def wait(self):
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self):
        self.latest.close()
        self.best.close()


def abstract_like(state):
    """ShapeDtypeStructs (with shardings) for a state, to restore into."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
