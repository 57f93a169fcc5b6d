"""The run config: typed sections, YAML files and dotted key=value overrides.

    model.*       ModelConfig fields, or model.preset=NAME (other model keys override it)
    data.*        DataConfig
    optim.*       OptimConfig
    train.*       TrainConfig
    checkpoint.*  CheckpointConfig
    mesh.*        MeshConfig (mesh.rules.NAME=AXES overrides a logical axis rule)
    distributed.* DistributedConfig
    objective.*   the objective's settings (objective.name picks the entry of
                  jaxformer.training.objectives.OBJECTIVES; the other keys are its own)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxformer.core import validation
from jaxformer.core.sharding import check_expert_split, resolve_rules
from jaxformer.core.validation import (ConfigError, build_section, check_choice, check_number,
                                       merge, read_config_file)
from jaxformer.data import DataConfig
from jaxformer.model.archs import ARCHS
from jaxformer.model.config import NESTED, PRESETS, ModelConfig
from jaxformer.positions.schemes import POSITION_SCHEMES
from jaxformer.training import objectives, profiling
from jaxformer.training.init_from import initial_sections
from jaxformer.training.optim import OptimConfig

RESUME = ("auto", "never")
WANDB_MODES = ("offline", "online")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    run_dir: str = "runs/default"
    resume: str = "auto"  # auto: continue from the latest checkpoint in run_dir; never: start over
    sample_tokens: int = 256
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    progress: bool = True
    init_from: str | None = None  # an HF folder or a run (RUN, RUN@STEP): jaxformer.training.init_from
    random_positions: int | None = None  # MAX: train on sorted random positions < MAX (data.random_positions)
    wandb: str | None = None  # a W&B project: metrics and config logged there (training/tracking.py)
    wandb_mode: str = "offline"  # offline: files in run_dir/wandb (wandb sync uploads them); online
    mtp_weight: float = 0.3  # lambda of the multi-token prediction loss (model.mtp_depth > 0)
    # model.loss_chunk, typed under model (RunConfig.from_dict moves it here: ModelConfig
    # describes the network, this the loss): positions per block of training.chunked_loss
    loss_chunk: int = 0
    profile: str | None = None  # START:STOP: a trace of those steps in RUN/profile (profiling)

    def __post_init__(self):
        o = "train"
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
            check_number(o, name, getattr(self, name), int, low=1)
        check_number(o, "seed", self.seed, int, low=0)
        check_number(o, "random_positions", self.random_positions, int, low=1, optional=True)
        if self.random_positions is not None and self.random_positions < self.seq_len:
            raise ConfigError(f"train.random_positions={self.random_positions} is less than "
                              f"train.seq_len={self.seq_len}: a row's tokens need distinct "
                              f"positions from [0, {self.random_positions}); raise it to at least "
                              f"{self.seq_len}")
        check_number(o, "sample_tokens", self.sample_tokens, int, low=0)
        check_number(o, "sample_temperature", self.sample_temperature, float, low=0)
        check_number(o, "mtp_weight", self.mtp_weight, float, low=0)
        check_number("model", "loss_chunk", self.loss_chunk, int, low=0)
        profiling.traced_steps(self.profile, self.steps)  # a bad START:STOP now, in one line
        check_choice(o, "resume", self.resume, RESUME)
        check_choice(o, "wandb_mode", self.wandb_mode, WANDB_MODES)
        if self.wandb is not None and (not isinstance(self.wandb, str) or not self.wandb or
                                       any(c in self.wandb for c in "/\\#?%:")):
            raise ConfigError(f"train.wandb={self.wandb!r} must be a W&B project name (none of "
                              "/ \\ # ? % :), or unset for no W&B")
        if not self.run_dir:
            raise ConfigError("train.run_dir must be a directory path")
        if self.init_from is not None and (not isinstance(self.init_from, str) or
                                           not self.init_from):
            raise ConfigError(f"train.init_from={self.init_from!r} must be a path")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200   # save every N steps (and at the end, and on SIGTERM / Ctrl-C)
    keep: int = 2      # keep the last N; the best by validation loss is kept apart
    async_save: bool = True

    def __post_init__(self):
        check_number("checkpoint", "every", self.every, int, low=1)
        check_number("checkpoint", "keep", self.keep, int, low=1)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ('data', 'fsdp', 'tensor', 'context', 'expert') device mesh; one axis may be -1:
    the rest of the devices. data=None (the default) is the rest, or 1 when another axis is
    -1; so mesh.fsdp=-1 alone is FSDP over every device. context: the devices one sequence
    is split over (context parallelism: jaxformer.attention.ring). expert: the devices a mixture's
    experts are split over (expert parallelism: jaxformer.moe.expert_parallel; the batch is
    split over them too; model.moe.experts must be a multiple). rules: logical axis -> mesh
    axes overrides of jaxformer.core.sharding.DEFAULT_RULES (e.g. {embed: null})."""

    data: int | None = None
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    expert: int = 1
    rules: dict | None = None

    AXES = ("data", "fsdp", "tensor", "context", "expert")

    def __post_init__(self):
        others = [getattr(self, name) for name in self.AXES[1:]]
        if self.data is None:
            object.__setattr__(self, "data", 1 if -1 in others else -1)
        for name in self.AXES:
            value = getattr(self, name)
            check_number("mesh", name, value, int, low=-1)
            if value == 0:
                raise ConfigError(f"mesh.{name}=0 must be >= 1, or -1 for the remaining devices")
        if [getattr(self, name) for name in self.AXES].count(-1) > 1:
            raise ConfigError("at most one of mesh.data / mesh.fsdp / mesh.tensor / "
                              "mesh.context / mesh.expert may be -1")
        if self.rules is not None and not isinstance(self.rules, Mapping):
            raise ConfigError(f"mesh.rules={self.rules!r} must be a mapping of logical axis "
                              "names to mesh axes")
        resolve_rules(self.rules)  # names and axes are checked now, not at the first step


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (hosts): jax.distributed.initialize before any device is used.
    Left empty, it is called without arguments when a launcher is detected (SLURM srun with
    several tasks, a Cloud TPU pod slice, Open MPI), and not at all on one process."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: str = "gloo"  # CPU-only runs: the cross-process collectives backend
    heartbeat_s: float = 10.0  # a process silent this long is lost: the others stop (exit 3)

    def __post_init__(self):
        o = "distributed"
        check_number(o, "num_processes", self.num_processes, int, low=1, optional=True)
        check_number(o, "process_id", self.process_id, int, low=0, optional=True)
        check_choice(o, "cpu_collectives", self.cpu_collectives, ("gloo", "mpi"))
        check_number(o, "heartbeat_s", self.heartbeat_s, float, low=1)
        address = self.coordinator_address
        if address is not None and (not isinstance(address, str) or ":" not in address):
            raise ConfigError(f"distributed.coordinator_address={self.coordinator_address!r} "
                              "must be host:port of process 0, e.g. 10.0.0.1:1234")
        if self.num_processes is not None and self.process_id is not None and \
                self.process_id >= self.num_processes:
            raise ConfigError(f"distributed.process_id={self.process_id} must be < "
                              f"distributed.num_processes={self.num_processes}")


# ObjectiveConfig(name, **settings): objective `name`'s settings (its entry's frozen
# settings class, jaxformer.training.objectives); the name of the flat class it replaced
ObjectiveConfig = objectives.settings
OBJECTIVES = objectives.OBJECTIVES  # objective.name -> its entry

SECTIONS: dict[str, Any] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                             "train": TrainConfig, "checkpoint": CheckpointConfig,
                             "mesh": MeshConfig, "distributed": DistributedConfig,
                             "objective": ObjectiveConfig}
READERS = {"objective": objectives.settings_from}  # sections not read as one dataclass


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    objective: Any = ObjectiveConfig()  # the entry's settings class, name=lm by default

    def __post_init__(self):
        self._check_objective()
        if self.train.batch_size % self.optim.grad_accum:
            raise ConfigError(f"train.batch_size={self.train.batch_size} must be a multiple of "
                              f"optim.grad_accum={self.optim.grad_accum}")
        check_expert_split(self.model.moe.experts, self.mesh.expert)  # -1: at the mesh
        longest = POSITION_SCHEMES[self.model.position].max_length
        if longest is not None and self.train.seq_len > longest(self.model):
            raise ConfigError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                              f"{self.model.max_seq_len}, the {self.model.position} position "
                              "table; raise model.max_seq_len or lower train.seq_len")
        top = self.train.random_positions
        if longest is not None and top is not None and top > longest(self.model):
            raise ConfigError(f"train.random_positions={top} exceeds model.max_seq_len="
                              f"{self.model.max_seq_len}, the {self.model.position} position "
                              "table's rows; raise model.max_seq_len or lower random_positions")

    def _check_objective(self):
        """The objective's model, data and starting weights (objectives.check_run), and
        the encoder-decoder's label smoothing, each refused in one line."""
        objectives.check_run(self)
        if self.optim.label_smoothing and not ARCHS[self.model.arch].encoder:
            raise ConfigError(f"optim.label_smoothing={self.optim.label_smoothing} is applied "
                              "by the encoder-decoder's loss only (model.arch=encoder_decoder); "
                              "set it to 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunConfig":
        values = dict(values or {})
        unknown = sorted(str(k) for k in set(values) - set(SECTIONS))  # YAML: `1: 2` too
        if unknown:
            raise ConfigError(f"unknown config section(s) {', '.join(unknown)}; sections are: "
                              f"{', '.join(SECTIONS)}")
        for name, raw in values.items():  # an empty section (None) is its defaults
            if raw is not None and not isinstance(raw, Mapping):
                raise ConfigError(f"{name} must be a mapping of its fields; got {raw!r}")
        values = moved_loss_chunk(values)  # before init_from's model takes the section
        values = initial_sections(values)  # train.init_from: the model it starts from
        sections = {}
        for name, section_cls in SECTIONS.items():
            raw = dict(values.get(name) or {})
            if name == "model" and "preset" in raw:
                preset = raw.pop("preset")
                if preset not in PRESETS:
                    raise ConfigError(f"unknown model.preset {preset!r}; presets are: "
                                      f"{', '.join(PRESETS)}")
                raw = merge(PRESETS[preset], raw)  # keeps the preset's other rope_scaling keys
            sections[name] = READERS[name](raw) if name in READERS else build_section(
                section_cls, raw, name, nested=NESTED,
                extra=" (or preset)" if name == "model" else "")
        return cls(**sections)


def moved_loss_chunk(values: Mapping[str, Any]) -> dict[str, Any]:
    """The sections with model.loss_chunk (where it is typed) moved to train.loss_chunk."""
    model = dict(values.get("model") or {})
    if "loss_chunk" not in model:
        return dict(values)
    train = {**(values.get("train") or {}), "loss_chunk": model.pop("loss_chunk")}
    return {**values, "model": model, "train": train}


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """A YAML file (or nothing: the defaults) with key=value overrides applied on top."""
    return RunConfig.from_dict(merge(read_config_file(path), parse_overrides(list(overrides))))


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """['train.steps=10', 'model.rope_scaling.kind=yarn'] -> the nested mapping of value
    strings, each key's section one of the run's (jaxformer.core.validation.parse_overrides)."""
    return validation.parse_overrides(items, SECTIONS)
