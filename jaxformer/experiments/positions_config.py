"""The positional-encoding study's config: a study section (StudySettings) beside the
run config's model, data, optim and train sections, from YAML and dotted key=value
overrides; unknown keys and settings the study makes itself fail with one line. Both
studies' columns are COLUMNS' entries (ModelVariant): a position scheme on the run's
model, or a model variant of recurrent and attention layers with its position scheme."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys
from typing import Any, Callable, Mapping

from jaxformer.core.validation import (check_choice, check_keys, check_number, coerce,
                                       read_config_file)
from jaxformer.model.config import ConfigError, ModelConfig
from jaxformer.positions.rope_scaling import ROPE_SCALINGS, RopeScaling
from jaxformer.positions.schemes import POSITION_SCHEMES
from jaxformer.training.config import RunConfig
from jaxformer.training.mlm import MaskedLM

# ---- the columns: a position scheme, or a model variant ---------------------------------

# A recurrent mixer's settings at the run's model size (model.mixer.<name>), by mixer: its
# heads the model's, each head's state as wide as an attention head's (Mamba-2 with its
# usual expansion of 2); chunks (gated DeltaNet's) short enough for the studies' lengths.
MIXER_SIZES: dict[str, Callable[[ModelConfig], dict]] = {
    "gated_delta": lambda m: {"heads": m.n_heads, "key_dim": m.head_dim,
                              "value_dim": m.head_dim, "chunk": 32},
    "mamba2": lambda m: {"heads": m.n_heads, "head_dim": 2 * m.head_dim, "state": m.head_dim},
    "short_conv": lambda m: {},
}


@dataclasses.dataclass(frozen=True)
class ModelVariant:
    """One column of the studies: the run's model with position scheme `position` and, where
    `pattern` is given, its layers replaced: `pattern` (model.layer_pattern, repeated over
    model.n_layers) of `kinds` ({kind: its model.layer_kinds fields}), every recurrent mixer
    sized by MIXER_SIZES. about: what the variant is, for the reports."""

    position: str
    pattern: tuple[str, ...] = ()
    kinds: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    about: str = ""

    def model(self, base: ModelConfig) -> ModelConfig:
        """`base` as this column's model (its position settings the scheme's defaults)."""
        if not self.pattern:
            return base.replace(position=self.position)
        if len(self.pattern) > base.n_layers:
            raise ConfigError(f"model.n_layers={base.n_layers} is fewer than the "
                              f"{len(self.pattern)} layers of one repeat of its pattern "
                              f"{list(self.pattern)}; raise model.n_layers")
        mixers = sorted({k["mixer"] for k in self.kinds.values() if "mixer" in k})
        return base.replace(position=self.position,
                            layer_pattern=self.pattern,
                            layer_kinds={n: dict(k) for n, k in self.kinds.items()},
                            mixer={m: MIXER_SIZES[m](base) for m in mixers} or None)


HYBRID = ("delta", "delta", "delta", "attn")  # 3 recurrent : 1 attention (Qwen3-Next's mix)
DELTA_KINDS = {"delta": {"mixer": "gated_delta"}, "attn": {}}
MODEL_VARIANTS: dict[str, ModelVariant] = {
    "hybrid-rope": ModelVariant("rope", HYBRID, DELTA_KINDS,
                                "3 gated DeltaNet layers : 1 attention layer with RoPE"),
    "hybrid-nope": ModelVariant("none", HYBRID, DELTA_KINDS,
                                "3 gated DeltaNet layers : 1 attention layer, no positions"),
    "hybrid-alibi": ModelVariant("alibi", HYBRID, DELTA_KINDS,
                                 "3 gated DeltaNet layers : 1 attention layer with ALiBi"),
    "hybrid-conv": ModelVariant("rope", ("conv", "conv", "attn"),
                                {"conv": {"mixer": "short_conv"}, "attn": {}},
                                "2 gated short convolutions (LFM2's) : 1 attention layer "
                                "with RoPE"),
    "gated_delta": ModelVariant("none", ("delta",), {"delta": {"mixer": "gated_delta"}},
                                "gated DeltaNet in every layer (each with its FFN), no "
                                "positions"),
    "mamba2": ModelVariant("none", ("ssd",), {"ssd": {"mixer": "mamba2"}},
                           "Mamba-2 in every layer (each with its FFN), no positions"),
}
# Every column either study compares: each position scheme on the run's layers, then the
# model variants.
COLUMNS: dict[str, ModelVariant] = {**{name: ModelVariant(name) for name in POSITION_SCHEMES},
                                    **MODEL_VARIANTS}


def column_model(name: str, base: ModelConfig) -> ModelConfig:
    """Column `name`'s model from the run's; a variant that cannot be built fails in one
    line naming it."""
    try:
        return COLUMNS[name].model(base)
    except ConfigError as e:
        raise ConfigError(f"study.schemes {name}: {e}") from None


def column_fields(name: str, mcfg: ModelConfig) -> dict[str, str]:
    """What the results record of column `name`'s model `mcfg`: its position scheme, its
    layers' mixers (layers_text) and what the variant is (COLUMNS; '' for a scheme)."""
    return {"position": mcfg.position, "layers": layers_text(mcfg), "about": COLUMNS[name].about}


def layers_text(mcfg: ModelConfig) -> str:
    """The layers' mixers in runs, e.g. '3 gated_delta, 1 attention, 3 gated_delta, ...'."""
    runs: list[list] = []
    for mixer in mcfg.layer_mixers:
        if runs and runs[-1][0] == mixer:
            runs[-1][1] += 1
        else:
            runs.append([mixer, 1])
    return ", ".join(f"{count} {mixer}" for mixer, count in runs)


DEFAULT_CONFIG = (pathlib.Path(__file__).resolve().parents[2] /
                  "configs/experiments/positions.yaml")
# mesh: for evaluation; objective: lm, or mlm for model.arch=encoder
# objective.name -> the study's objective of (RunConfig, tokenizer): None, the LM loss
STUDY_OBJECTIVES = {"lm": lambda run, tokenizer: None, "mlm": MaskedLM.of}
SECTIONS = ("study", "model", "data", "optim", "train", "mesh", "objective")
TRAIN_KEYS = ("steps", "batch_size", "seq_len", "seed", "log_every", "random_positions")
SET_BY_STUDY = {"position": "choose schemes with study.schemes",
                "rope_scaling": "RoPE scaling is applied at evaluation only: study.rope_scaling",
                "max_seq_len": "it is train.seq_len (L) for learned positions, the longest "
                               "evaluation length for the others"}
# A run of well under a minute on a CPU (--small; the notebooks under JAXFORMER_SMALL=1).
SMALL = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=16",
         "train.batch_size=16", "train.steps=150", "train.log_every=50",
         "optim.warmup_steps=10", "study.eval_tokens=2048", "study.eval_multiples=1,4,32")


@dataclasses.dataclass(frozen=True)
class StudySettings:
    """schemes: the columns compared, one model each: model.position values (a scheme on
      the run's model) or model variants (MODEL_VARIANTS: e.g. hybrid-rope); see COLUMNS.
    eval_multiples: the evaluation lengths, as multiples of L = train.seq_len.
    rope_scaling: RoPE scaling kinds applied at evaluation only (factor = the multiple) to
      the trained models of scaled_schemes (columns whose scheme is rotary); one extra row
      each, for each of those columns among the schemes.
    eval_tokens: validation tokens scored at every length (rounded down to a multiple of
      every evaluation length, so each length scores the same tokens).
    eval_batch_tokens: tokens per evaluation forward pass.
    seeds: repeats with train.seed, train.seed + 1, ...; the table gives mean and std.
    out_dir: where results.json, results.md and positions.png are written.
    progress: print progress lines while it runs.
    """

    schemes: tuple[str, ...] = tuple(POSITION_SCHEMES)
    eval_multiples: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rope_scaling: tuple[str, ...] = ("yarn",)
    scaled_schemes: tuple[str, ...] = ("rope",)
    eval_tokens: int = 32768
    eval_batch_tokens: int = 8192
    seeds: int = 1
    out_dir: str = "runs/positions"
    progress: bool = True

    def __post_init__(self):
        scalings = tuple(n for n, r in ROPE_SCALINGS.items() if r.scales)
        check_settings(self, choices={"schemes": tuple(COLUMNS), "rope_scaling": scalings,
                                      "scaled_schemes": tuple(COLUMNS)},
                       increasing=("eval_multiples",),
                       positive=("eval_tokens", "eval_batch_tokens", "seeds"))
        if not self.schemes:
            raise ConfigError(f"study.schemes is empty; choose from {', '.join(COLUMNS)}")


def check_settings(settings, *, choices: Mapping[str, tuple[str, ...]],
                   increasing: tuple[str, ...], positive: tuple[str, ...]) -> None:
    """What every study's settings share: lists of choices without repeats, increasing
    non-empty lists of ints >= 1, ints >= 1, an out_dir and a progress flag."""
    for name, allowed in choices.items():
        values = getattr(settings, name)
        for value in values:
            check_choice("study", name, value, allowed)
        if len(set(values)) != len(values):
            raise ConfigError(f"study.{name}={list(values)} names a value twice")
    for name in increasing:
        values = getattr(settings, name)
        if not values:
            raise ConfigError(f"study.{name} is empty; e.g. [1, 2, 4, 8]")
        for v in values:
            check_number("study", name, v, int, low=1)
        if list(values) != sorted(set(values)):
            raise ConfigError(f"study.{name}={list(values)} must increase")
    for name in positive:
        check_number("study", name, getattr(settings, name), int, low=1)
    if not isinstance(settings.out_dir, str) or not settings.out_dir:
        raise ConfigError(f"study.out_dir={settings.out_dir!r} must be a directory path")
    if not isinstance(settings.progress, bool):
        raise ConfigError(f"study.progress={settings.progress!r} must be true or false")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    study: StudySettings
    run: RunConfig  # model (its position unused), data, optim, train, objective

    def __post_init__(self):
        if self.run.objective.name not in STUDY_OBJECTIVES:
            raise ConfigError(f"objective.name={self.run.objective.name} is not one the study "
                              "scores; use lm (a decoder) or mlm (model.arch=encoder)")
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
        """Column `scheme`'s model (COLUMNS: the run's model with this position scheme, or a
        model variant); the learned table has L rows (or train.random_positions, the
        positions it trains)."""
        length = max(self.run.train.seq_len, self.run.train.random_positions or 0)
        longest = max(length, *self.eval_lengths)
        table = POSITION_SCHEMES[COLUMNS[scheme].position].max_length is not None  # L rows
        return column_model(scheme, self.run.model).replace(
            rope_scaling=RopeScaling(), max_seq_len=length if table else longest)

    def to_dict(self) -> dict[str, Any]:
        return study_dict(self.study, self.run, ("model", "data", "optim", "objective"))

    def objective(self, tokenizer=None):
        """The training and scoring objective: None for lm, MLM's for an encoder (which
        never masks the data's `tokenizer`'s end-of-text)."""
        return STUDY_OBJECTIVES[self.run.objective.name](self.run, tokenizer)


def study_dict(study, run: RunConfig, sections) -> dict[str, Any]:
    """A study's resolved config as written beside its results: the study settings, the
    run's `sections` whole, and the train keys a study reads (TRAIN_KEYS)."""
    values = run.to_dict()
    return {"study": dataclasses.asdict(study), **{name: values[name] for name in sections},
            "train": {k: values["train"][k] for k in TRAIN_KEYS}}


def settings_from_dict(cls, raw: Mapping[str, Any], section: str = "study"):
    """A settings dataclass from YAML or command-line values, each coerced to its field's
    type ('rope,alibi' is a list; '1,2' a list of ints where the field holds ints)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_keys(raw, fields, section)
    values = {}
    for key, value in raw.items():
        default, type_name, name = fields[key].default, str(fields[key].type), f"{section}.{key}"
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [] if value.strip().lower() in ("", "none", "[]") else \
                    [v.strip() for v in value.strip("[]").split(",")]
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{name}={value!r} must be a list, e.g. {list(default)}")
            if "int" in type_name:
                value = tuple(coerce(v, "int", name) for v in value)
            value = tuple(value)
        elif isinstance(default, (bool, int)):
            value = coerce(value, "bool" if isinstance(default, bool) else "int", name)
        values[key] = value
    return cls(**values)


def read_sections(path: str | None, overrides, sections: tuple[str, ...],
                  example: str) -> dict[str, dict[str, Any]]:
    """A study's YAML file of sections with dotted key=value overrides applied: {section:
    its mapping} for every one of `sections`; any other section fails."""
    raw = read_config_file(path, example)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, value = item.split("=", 1)
        *parents, leaf = key.strip().split(".")
        if not parents:
            raise ConfigError(f"override key {key!r} must be section.field, with section one "
                              f"of: {', '.join(sections)}")
        node = raw
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(f"override {key!r} sets a field inside a non-mapping value")
            node = node[part]
        node[leaf] = value
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; the study's sections are: "
                          f"{', '.join(sections)} (it writes no checkpoints)")
    bad = [name for name in sections if not isinstance(raw.get(name) or {}, Mapping)]
    if bad:
        raise ConfigError(f"section {bad[0]} must be a mapping of keys to values, e.g. "
                          f"{bad[0]}: {{...}}")
    return {name: dict(raw.get(name) or {}) for name in sections}


def check_run_sections(sections: dict[str, dict], set_by_study: Mapping[str, str]) -> None:
    """Fails on model keys the study sets itself (`set_by_study`: key -> why) and on train
    keys other than TRAIN_KEYS; turns the run's own progress printing off."""
    for key, hint in set_by_study.items():
        if key in sections["model"]:
            raise ConfigError(f"model.{key} is set by the study: {hint}")
    unused = sorted(set(sections["train"]) - set(TRAIN_KEYS))
    if unused:
        raise ConfigError(f"{', '.join('train.' + k for k in unused)} not used by the study; "
                          f"its train keys are: {', '.join(TRAIN_KEYS)}")
    sections["train"]["progress"] = False


def load_study_config(path: str | None = None, overrides=()) -> StudyConfig:
    """A YAML file of sections (study, model, data, optim, train, mesh) with key=value
    overrides. mesh.context > 1 evaluates with the sequence split over that many devices."""
    sections = read_sections(path, overrides, SECTIONS, "configs/experiments/positions.yaml")
    check_run_sections(sections, SET_BY_STUDY)
    study = settings_from_dict(StudySettings, sections.pop("study"))
    return StudyConfig(study, RunConfig.from_dict(sections))


def parse_study_args(argv, *, prog: str, description: str, default_config,
                     small: tuple[str, ...], eval_lengths=None) -> tuple[str, list[str]]:
    """A study's command line, [CONFIG.yaml] [section.key=value ...] [--seeds N] [--out DIR]
    [--small] [--eval-lengths LIST], as (config path, overrides): --small's first, then the
    command line's. eval_lengths: (help, LIST -> an override; ValueError if malformed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [section.key=value]")
    parser.add_argument("--seeds", type=int, help="repeat with N seeds; report mean and std")
    parser.add_argument("--out", help="output directory (study.out_dir)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: well under a minute")
    if eval_lengths is not None:
        parser.add_argument("--eval-lengths", metavar="LIST", help=eval_lengths[0])
    a = parser.parse_intermixed_args(argv)
    path = a.args[0] if a.args and "=" not in a.args[0] else str(default_config)
    overrides = [x for x in a.args if "=" in x]
    stray = [x for x in a.args if "=" not in x and x != path]
    if stray:
        parser.error(f"unexpected argument(s) {' '.join(stray)}")
    if getattr(a, "eval_lengths", None) is not None:
        try:
            overrides.append(eval_lengths[1](a.eval_lengths))
        except ValueError as e:
            parser.error(f"--eval-lengths {a.eval_lengths}: {e}")
    return path, [*(small if a.small else ()), *overrides,
                  *([f"study.seeds={a.seeds}"] if a.seeds is not None else []),
                  *([f"study.out_dir={a.out}"] if a.out else [])]


def multiples_of_l(text: str) -> str:
    """'L,2L,4L,32L' -> the override study.eval_multiples=1,2,4,32."""
    found = [re.fullmatch(r"\s*(\d*)\s*L\s*", item) for item in text.split(",")]
    if not all(found) or any(int(m.group(1) or 1) == 0 for m in found):
        raise ValueError("give multiples of the training length L, e.g. L,2L,4L,8L,16L,32L")
    return "study.eval_multiples=" + ",".join(m.group(1) or "1" for m in found)


def study_main(argv, *, doc: str, prog: str, default_config, small, load, run, write,
               errors=(ConfigError,), eval_lengths=None) -> int:
    """A study's command line: load(path, overrides) -> config, run(config) -> results,
    write(results, out_dir) -> {kind: path}; the Markdown printed, an error in `errors`
    one line on stderr and exit 2. eval_lengths: see parse_study_args."""
    path, overrides = parse_study_args(argv, prog=prog, description=doc.split("\n\n")[0],
                                       default_config=default_config, small=small,
                                       eval_lengths=eval_lengths)
    try:
        cfg = load(path, overrides)
        results = run(cfg)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write(results, cfg.study.out_dir)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {results['seconds']:.0f} s")
    return 0
