"""Adapter-sized checkpoints. A LoRA run started from given weights (model.lora.rank > 0
and train.init_from) saves its adapters, their lora_scale and the optimizer state (the
adapters' alone), never the frozen base, which it can read again from where it came.

Each save's info item records that base: train.init_from as given, the source it
resolved to (an absolute path; a run's as RUN@STEP, its step pinned) and the sha256 of
its weights as loaded (`checksum`). A restore (resume, generate --run, convert, a run
started from this one) loads the base from the recorded source, or from train.init_from
when the config at hand names another (a base that moved), checks its sha256, and joins
it to the adapters. A base that is not found, or whose weights changed, stops the
restore with one line naming the recorded source and what was found.

A LoRA run from a random base (no train.init_from) is saved in full, as any run. A full
checkpoint of an adapter run (saved before this existed) still restores, and the base it
holds is recorded for the run's next saves.
"""

from __future__ import annotations

import hashlib
import pathlib

import jax
import numpy as np
from flax.traverse_util import flatten_dict
from jax.experimental.multihost_utils import process_allgather

from jaxformer.model import lora
from jaxformer.model.config import ConfigError
from jaxformer.training.checkpoint import Checkpointer, CheckpointError
from jaxformer.training.init_from import parse_source


def adapters_only(cfg) -> bool:
    """Whether a run (a RunConfig) saves its adapters without the base."""
    return bool(cfg.model.lora.rank and cfg.train.init_from)


def checksum(params) -> str:
    """sha256 of a params tree: each leaf's path, dtype, shape and bytes in path order (a
    leaf at a time on the host; one sharded over processes is gathered)."""
    h = hashlib.sha256()
    for path, x in sorted(flatten_dict(dict(params), sep="/").items()):
        if not getattr(x, "is_fully_addressable", True):
            x = process_allgather(x, tiled=True)
        x = np.ascontiguousarray(jax.device_get(x))
        h.update(f"{path}:{x.dtype.name}:{x.shape};".encode())
        h.update(x.reshape(-1).view(np.uint8))
    return h.hexdigest()


def pinned(spec: str) -> str:
    """train.init_from as an absolute source: the folder, or RUN@STEP (a run without a step
    at its latest checkpoint now)."""
    src = parse_source(spec)
    path = src.path.resolve()
    if src.kind == "hf":
        return str(path)
    step = src.step
    if step is None:
        ckpt = Checkpointer(path, keep=1 << 30, async_save=False, read_only=True)
        try:
            step = ckpt.latest_step()
        finally:
            ckpt.close()
    return f"{path}@{step}"


def run_checkpointer(cfg, run_dir, *, load, **kwargs) -> Checkpointer:
    """The checkpoints of a run (a RunConfig): adapter-sized when adapters_only(cfg).
    load: spec -> the base's weights placed as this process wants them
    (initial_weights.base_loader, or one_device_loader for a reader of the run); kwargs:
    Checkpointer's."""
    if not adapters_only(cfg):
        return Checkpointer(run_dir, **kwargs)
    return AdapterCheckpointer(run_dir, cfg.train.init_from, load, **kwargs)


def keep_base(ckpt: Checkpointer, params):
    """A new run from train.init_from: an adapter-sized `ckpt` records the base in `params`
    (its saves will carry the record). Call before the first step donates the params."""
    if isinstance(ckpt, AdapterCheckpointer):
        ckpt.record = ckpt.base_record(ckpt.spec, lora.partition(params, scales=True)[2])


class AdapterCheckpointer(Checkpointer):
    """A Checkpointer whose saves leave out the frozen base. spec: the run's train.init_from;
    load: spec -> the base's weights (placed); kwargs: Checkpointer's."""

    def __init__(self, run_dir, spec: str, load, **kwargs):
        super().__init__(run_dir, **kwargs)
        self.run_dir, self.spec, self.load = pathlib.Path(run_dir), spec, load
        self.read_only = kwargs.get("read_only", False)

    @staticmethod
    def base_record(spec: str, base) -> dict:
        return {"base": {"init_from": spec, "source": pinned(spec), "sha256": checksum(base)}}

    def save(self, step: int, state, model_cfg, **kwargs):
        """Checkpointer.save of the state without the frozen base."""
        if not self.record:
            raise CheckpointError("an adapter-sized save needs its base recorded first "
                                  "(adapter_checkpoint.keep_base)")
        adapters, scales, _ = lora.partition(state.params, scales=True)
        super().save(step, state.replace(params=lora.combine(adapters, scales)), model_cfg,
                     **kwargs)

    def restore(self, abstract_state, model_cfg, *, best: bool = False, **kwargs):
        """Checkpointer.restore of the adapters, joined to the recorded base (checked)."""
        adapters, scales, _ = lora.partition(abstract_state.params, scales=True)
        try:
            state = super().restore(abstract_state.replace(params=lora.combine(adapters, scales)),
                                    model_cfg, best=best, **kwargs)
        except ConfigError as adapter_error:  # a full checkpoint, saved before these?
            try:
                state = super().restore(abstract_state, model_cfg, best=best, **kwargs)
            except ConfigError:
                raise adapter_error from None
            self.log(f"checkpoint {int(state.step)} of {self.run_dir} holds its base (saved "
                     "before adapter-sized checkpoints); the next saves hold the adapters alone")
            if not self.read_only:
                self.record = self.base_record(self.spec, lora.partition(state.params,
                                                                         scales=True)[2])
            return state
        recorded = self.saved_info(int(state.step), best=best).get("base")
        return state.replace(params=lora.combine(state.params, self.checked_base(recorded)))

    def checked_base(self, recorded: dict | None):
        """The base `recorded` names, loaded from its source (or train.init_from when the
        config names another) and checked against its sha256."""
        if not recorded:
            raise CheckpointError(f"{self.run_dir}: a checkpoint of adapters without the "
                                  "record of their base; it cannot be restored")
        moved = self.spec != recorded["init_from"]  # the config at hand points elsewhere
        source, want = (self.spec if moved else recorded["source"]), recorded["sha256"]
        trained_on = (f"{self.run_dir}'s adapters were trained on the base "
                      f"{recorded['source']} (sha256 {want[:16]})")
        try:
            base = self.load(source)
        except FileNotFoundError as e:  # (a CheckpointError: "no checkpoint" means another thing)
            raise CheckpointError(
                f"{trained_on}, but {source} is not found ({str(e).splitlines()[0]}); if the "
                f"base moved, point train.init_from at it (train.init_from=PATH to resume, "
                f"or in {self.run_dir}/config.yaml for generate and convert)") from None
        found = checksum(base)
        if found != want:
            raise CheckpointError(
                f"{trained_on}, but the weights at {source} have sha256 {found[:16]}: the "
                "base changed; restore the one the adapters were trained on, or point "
                "train.init_from at a copy of it")
        self.log(f"base {source}: sha256 {found[:16]}, as the adapters' checkpoint recorded")
        self.record = {"base": {**recorded, "init_from": self.spec,
                                "source": pinned(source) if moved else recorded["source"]}}
        return base
