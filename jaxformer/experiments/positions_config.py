"""The positional-encoding study's config: a study section (StudySettings) beside the
run config's model, data, optim and train sections, from YAML and dotted key=value
overrides; unknown keys and settings the study makes itself fail with one line."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Mapping


from jaxformer.config import (POSITIONS, ROPE_SCALINGS, ConfigError, ModelConfig, RopeScaling,
                              _check_choice, _check_number)
from jaxformer.training.config import RunConfig, _coerce, read_config_file

DEFAULT_CONFIG = (pathlib.Path(__file__).resolve().parents[2] /
                  "configs/experiments/positions.yaml")
SECTIONS = ("study", "model", "data", "optim", "train")
TRAIN_KEYS = ("steps", "batch_size", "seq_len", "seed", "log_every")
SET_BY_STUDY = {"position": "choose schemes with study.schemes",
                "rope_scaling": "RoPE scaling is applied at evaluation only: study.rope_scaling",
                "max_seq_len": "it is train.seq_len (L) for learned positions, the longest "
                               "evaluation length for the others"}
# A run of well under a minute on a CPU (--small; the notebooks under JAXFORMER_SMALL=1).
SMALL = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=16",
         "train.batch_size=16", "train.steps=150", "train.log_every=50",
         "optim.warmup_steps=10", "study.eval_tokens=2048")


@dataclasses.dataclass(frozen=True)
class StudySettings:
    """schemes: the model.position values compared, one model each.
    eval_multiples: the evaluation lengths, as multiples of L = train.seq_len.
    rope_scaling: RoPE scaling kinds applied to the trained RoPE model at evaluation
      only (factor = the multiple); one extra row each, when rope is among the schemes.
    eval_tokens: validation tokens scored at every length (rounded down to a multiple of
      every evaluation length, so each length scores the same tokens).
    eval_batch_tokens: tokens per evaluation forward pass.
    seeds: repeats with train.seed, train.seed + 1, ...; the table gives mean and std.
    out_dir: where results.json, results.md and positions.png are written.
    progress: print progress lines while it runs.
    """

    schemes: tuple[str, ...] = POSITIONS
    eval_multiples: tuple[int, ...] = (1, 2, 4, 8)
    rope_scaling: tuple[str, ...] = ("yarn",)
    eval_tokens: int = 32768
    eval_batch_tokens: int = 8192
    seeds: int = 1
    out_dir: str = "runs/positions"
    progress: bool = True

    def __post_init__(self):
        for name, allowed in (("schemes", POSITIONS), ("rope_scaling", ROPE_SCALINGS[1:])):
            values = getattr(self, name)
            for value in values:
                _check_choice("study", name, value, allowed)
            if len(set(values)) != len(values):
                raise ConfigError(f"study.{name}={list(values)} names a value twice")
        if not self.schemes:
            raise ConfigError(f"study.schemes is empty; choose from {', '.join(POSITIONS)}")
        if not self.eval_multiples:
            raise ConfigError("study.eval_multiples is empty; e.g. [1, 2, 4, 8]")
        for m in self.eval_multiples:
            _check_number("study", "eval_multiples", m, int, low=1)
        if list(self.eval_multiples) != sorted(set(self.eval_multiples)):
            raise ConfigError(f"study.eval_multiples={list(self.eval_multiples)} must increase")
        for name in ("eval_tokens", "eval_batch_tokens", "seeds"):
            _check_number("study", name, getattr(self, name), int, low=1)
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ConfigError(f"study.out_dir={self.out_dir!r} must be a directory path")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"study.progress={self.progress!r} must be true or false")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    study: StudySettings
    run: RunConfig  # model (its position unused), data, optim, train

    def __post_init__(self):
        if self.run.data.pack:
            raise ConfigError("data.pack=true is not supported by the study: it evaluates "
                              "unpacked windows, so it trains on unpacked ones too")
        for scheme in self.study.schemes:  # every model builds, before anything trains
            self.model_config(scheme)
        if self.eval_tokens == 0:
            raise ConfigError(f"study.eval_tokens={self.study.eval_tokens} is less than one "
                              f"window of every evaluation length ({math.lcm(*self.eval_lengths)}"
                              " tokens)")

    @property
    def eval_lengths(self) -> list[int]:
        return [m * self.run.train.seq_len for m in self.study.eval_multiples]

    @property
    def eval_tokens(self) -> int:
        """study.eval_tokens rounded down to a multiple of every evaluation length."""
        step = math.lcm(*self.eval_lengths)
        return self.study.eval_tokens // step * step

    def model_config(self, scheme: str) -> ModelConfig:
        """The run's model with this position scheme; the learned table has L rows."""
        length = self.run.train.seq_len
        longest = max(length, *self.eval_lengths)
        return self.run.model.replace(position=scheme, rope_scaling=RopeScaling(),
                                      max_seq_len=length if scheme == "learned" else longest)

    def to_dict(self) -> dict[str, Any]:
        run = self.run.to_dict()
        train = {k: run["train"][k] for k in TRAIN_KEYS}
        return {"study": dataclasses.asdict(self.study), "model": run["model"],
                "data": run["data"], "optim": run["optim"], "train": train}


def _study_settings(raw: Mapping[str, Any]) -> StudySettings:
    """study.* values from YAML or the command line ('rope,alibi' is a list) to their types."""
    fields = {f.name: f.default for f in dataclasses.fields(StudySettings)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join('study.' + k for k in unknown)}; valid "
                          f"study keys are: {', '.join(fields)}")
    values = {}
    for key, value in raw.items():
        default = fields[key]
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [] if value.strip().lower() in ("", "none", "[]") else \
                    [v.strip() for v in value.strip("[]").split(",")]
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"study.{key}={value!r} must be a list, e.g. {list(default)}")
            if key == "eval_multiples":
                value = [_coerce(v, "int", f"study.{key}") for v in value]
        elif isinstance(default, bool):
            value = _coerce(value, "bool", f"study.{key}")
        elif isinstance(default, int):
            value = _coerce(value, "int", f"study.{key}")
        values[key] = tuple(value) if isinstance(value, list) else value
    return StudySettings(**values)


def load_study_config(path: str | None = None, overrides=()) -> StudyConfig:
    """A YAML file of sections (study, model, data, optim, train) with key=value overrides."""
    raw = read_config_file(path, "configs/experiments/positions.yaml")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, value = item.split("=", 1)
        *parents, leaf = key.strip().split(".")
        if not parents:
            raise ConfigError(f"override key {key!r} must be section.field, with section one "
                              f"of: {', '.join(SECTIONS)}")
        node = raw
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(f"override {key!r} sets a field inside a non-mapping value")
            node = node[part]
        node[leaf] = value
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; the study's sections are: "
                          f"{', '.join(SECTIONS)} (it writes no checkpoints)")
    bad = [name for name in SECTIONS if not isinstance(raw.get(name) or {}, Mapping)]
    if bad:
        raise ConfigError(f"section {bad[0]} must be a mapping of keys to values, e.g. "
                          f"{bad[0]}: {{...}}")
    sections = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    for key, hint in SET_BY_STUDY.items():
        if key in sections["model"]:
            raise ConfigError(f"model.{key} is set by the study: {hint}")
    unused = sorted(set(sections["train"]) - set(TRAIN_KEYS))
    if unused:
        raise ConfigError(f"{', '.join('train.' + k for k in unused)} not used by the study; "
                          f"its train keys are: {', '.join(TRAIN_KEYS)}")
    sections["train"]["progress"] = False
    study = _study_settings(sections.pop("study"))
    return StudyConfig(study, RunConfig.from_dict(sections))
