"""The run config: typed sections, YAML files and dotted key=value overrides.

    model.*       ModelConfig fields, or model.preset=NAME (other model keys override it)
    data.*        DataConfig
    optim.*       OptimConfig
    train.*       TrainConfig
    checkpoint.*  CheckpointConfig
    mesh.*        MeshConfig (mesh.rules.NAME=AXES overrides a logical axis rule)
    distributed.* DistributedConfig
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

import yaml

from jaxformer.config import (PRESETS, ConfigError, ModelConfig, RopeScaling, _check_choice,
                              _check_number)
from jaxformer.data import DataConfig
from jaxformer.sharding import resolve_rules

SCHEDULES = ("cosine", "inverse_sqrt", "constant", "linear")
RESUME = ("auto", "never")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with a learning-rate schedule, global-norm clipping and gradient accumulation.

    schedule: cosine (linear warmup, cosine decay to lr * min_lr_ratio), linear (warmup,
    linear decay to lr * min_lr_ratio), constant (warmup, then lr), inverse_sqrt
    (lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): Vaswani et al. with lr = 1).
    """

    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    grad_accum: int = 1
    max_skips: int = 5  # consecutive non-finite steps before the run stops

    def __post_init__(self):
        o = "optim"
        _check_number(o, "lr", self.lr, float, low=0, low_open=True)
        _check_choice(o, "schedule", self.schedule, SCHEDULES)
        _check_number(o, "warmup_steps", self.warmup_steps, int, low=0)
        if self.schedule == "inverse_sqrt" and self.warmup_steps < 1:
            raise ConfigError("optim.warmup_steps must be >= 1 for schedule=inverse_sqrt")
        _check_number(o, "min_lr_ratio", self.min_lr_ratio, float, low=0, high=1)
        _check_number(o, "b1", self.b1, float, low=0, high=1, high_open=True)
        _check_number(o, "b2", self.b2, float, low=0, high=1, high_open=True)
        _check_number(o, "eps", self.eps, float, low=0)
        _check_number(o, "weight_decay", self.weight_decay, float, low=0)
        _check_number(o, "clip_norm", self.clip_norm, float, low=0, low_open=True, optional=True)
        _check_number(o, "grad_accum", self.grad_accum, int, low=1)
        _check_number(o, "max_skips", self.max_skips, int, low=1)


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

    def __post_init__(self):
        o = "train"
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
            _check_number(o, name, getattr(self, name), int, low=1)
        _check_number(o, "seed", self.seed, int, low=0)
        _check_number(o, "sample_tokens", self.sample_tokens, int, low=0)
        _check_number(o, "sample_temperature", self.sample_temperature, float, low=0)
        _check_choice(o, "resume", self.resume, RESUME)
        if not self.run_dir:
            raise ConfigError("train.run_dir must be a directory path")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200   # save every N steps (and at the end, and on SIGTERM / Ctrl-C)
    keep: int = 2      # keep the last N; the best by validation loss is kept apart
    async_save: bool = True

    def __post_init__(self):
        _check_number("checkpoint", "every", self.every, int, low=1)
        _check_number("checkpoint", "keep", self.keep, int, low=1)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ('data', 'fsdp', 'tensor') device mesh; one axis may be -1: the rest of the
    devices. data=None (the default) is the rest, or 1 when fsdp or tensor is -1; so
    mesh.fsdp=-1 alone is FSDP over every device. rules: logical axis -> mesh axes
    overrides of jaxformer.sharding.DEFAULT_RULES (e.g. {embed: null})."""

    data: int | None = None
    fsdp: int = 1
    tensor: int = 1
    rules: dict | None = None

    def __post_init__(self):
        if self.data is None:
            object.__setattr__(self, "data", 1 if -1 in (self.fsdp, self.tensor) else -1)
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            _check_number("mesh", name, value, int, low=-1)
            if value == 0:
                raise ConfigError(f"mesh.{name}=0 must be >= 1, or -1 for the remaining devices")
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            raise ConfigError("at most one of mesh.data / mesh.fsdp / mesh.tensor may be -1")
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

    def __post_init__(self):
        o = "distributed"
        _check_number(o, "num_processes", self.num_processes, int, low=1, optional=True)
        _check_number(o, "process_id", self.process_id, int, low=0, optional=True)
        _check_choice(o, "cpu_collectives", self.cpu_collectives, ("gloo", "mpi"))
        if self.coordinator_address is not None and ":" not in str(self.coordinator_address):
            raise ConfigError(f"distributed.coordinator_address={self.coordinator_address!r} "
                              "must be host:port of process 0, e.g. 10.0.0.1:1234")
        if self.num_processes is not None and self.process_id is not None and \
                self.process_id >= self.num_processes:
            raise ConfigError(f"distributed.process_id={self.process_id} must be < "
                              f"distributed.num_processes={self.num_processes}")


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                             "train": TrainConfig, "checkpoint": CheckpointConfig,
                             "mesh": MeshConfig, "distributed": DistributedConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        if self.train.batch_size % self.optim.grad_accum:
            raise ConfigError(f"train.batch_size={self.train.batch_size} must be a multiple of "
                              f"optim.grad_accum={self.optim.grad_accum}")
        if self.model.position == "learned" and self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                              f"{self.model.max_seq_len}, the learned position table; raise "
                              "model.max_seq_len or lower train.seq_len")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunConfig":
        values = dict(values or {})
        unknown = sorted(set(values) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"unknown config section(s) {', '.join(unknown)}; sections are: "
                              f"{', '.join(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            raw = dict(values.get(name) or {})
            if name == "model" and "preset" in raw:
                preset = raw.pop("preset")
                if preset not in PRESETS:
                    raise ConfigError(f"unknown model.preset {preset!r}; presets are: "
                                      f"{', '.join(PRESETS)}")
                raw = _merge(PRESETS[preset], raw)  # keeps the preset's other rope_scaling keys
            sections[name] = _build(section_cls, raw, name)
        return cls(**sections)


def _type_names(cls) -> dict[str, str]:
    """Field name -> its annotation as text ('int | None'); these modules use postponed
    annotations, so the text is what the source says."""
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__
            for f in dataclasses.fields(cls)}


def _coerce(value: Any, type_name: str, key: str) -> Any:
    """Strings from YAML or the command line to the field's type ('3e-4' -> 0.0003)."""
    if value is None or not isinstance(value, str):
        if isinstance(value, int) and not isinstance(value, bool) and "float" in type_name \
                and "int" not in type_name:
            return float(value)
        if type_name.startswith("str") and isinstance(value, (int, float)) and \
                not isinstance(value, bool):
            return str(value)  # YAML read `run_dir: 2024` as a number
        return value
    if value.lower() in ("none", "null", "~") and "None" in type_name:
        return None
    try:
        if "int" in type_name and "float" not in type_name:
            return int(value)
        if "float" in type_name:
            return float(value)
    except ValueError:
        kind = "an int" if "int" in type_name and "float" not in type_name else "a number"
        raise ConfigError(f"{key}={value!r} must be {kind}") from None
    if "bool" in type_name:
        if value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def _build(cls, raw: Mapping[str, Any], section: str):
    types = _type_names(cls)
    unknown = sorted(set(raw) - set(types))
    if unknown:
        extra = " (or preset)" if section == "model" else ""
        raise ConfigError(f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; valid "
                          f"{section} keys are: {', '.join(types)}{extra}")
    values = {}
    for key, value in raw.items():
        if key == "rope_scaling" and isinstance(value, Mapping):
            rs_types = _type_names(RopeScaling)
            bad = sorted(set(value) - set(rs_types))
            if bad:
                raise ConfigError(f"unknown key(s) {', '.join('model.rope_scaling.' + b for b in bad)}"
                                  f"; valid keys are: {', '.join(rs_types)}")
            value = {k: _coerce(v, rs_types[k], f"model.rope_scaling.{k}") for k, v in value.items()}
        else:
            value = _coerce(value, types[key], f"{section}.{key}")
        values[key] = value
    return cls(**values)


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """['train.steps=10', 'model.rope_scaling.kind=yarn'] -> nested mapping of the value
    strings, exactly as typed (a trailing space in train.sample_prompt stays)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"override key {key!r} must be section.field with section one of: "
                              f"{', '.join(SECTIONS)}")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} sets a field inside a non-mapping value")
        node[parts[-1]] = value  # a string: _coerce gives it its field's type
    return out


def _merge(base: dict, extra: Mapping) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, Mapping) and isinstance(
            merged.get(k), Mapping) else v
    return merged


def read_config_file(path: str | None, example: str = "configs/tiny.yaml") -> dict[str, Any]:
    """The mapping of sections in a YAML config file (yaml.safe_load); {} for None."""
    if path is None:
        return {}
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist; configs live in configs/, "
                          f"e.g. {example}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return raw


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """A YAML file (or nothing: the defaults) with key=value overrides applied on top."""
    return RunConfig.from_dict(_merge(read_config_file(path), parse_overrides(list(overrides))))
