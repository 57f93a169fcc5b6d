"""Training objectives (objective.name): one table, OBJECTIVES, of one entry per
objective (entry.Objective: its settings, step hooks, the model and batches it trains,
its metrics, perplexity, reference and rollouts). Each module of this package that
defines an ENTRY is one objective, gathered here by its settings' name, so a new
objective is one new module: language_model.py (lm), masked_lm.py (mlm), preference.py
(dpo), group_policy.py (grpo) and the rest, each module's docstring its objective.

The objective section of a config is parsed here (settings_from): `name` picks the
entry, whose settings class takes the other keys.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.validation import ConfigError, check_choice, coerce, type_names
from jaxformer.training.objectives.entry import Objective, batches_of, formats_for
from jaxformer.training.objectives.preference import (METRICS, Preference, answer_logps,
                                                      dpo_loss, pair_terms)


def _gather() -> dict[str, Objective]:
    """objective.name -> entry, from every module of this package that defines ENTRY."""
    entries = [getattr(importlib.import_module(f"{__name__}.{m.name}"), "ENTRY", None)
               for m in pkgutil.iter_modules(__path__)]
    return {e.name: e for e in sorted((e for e in entries if e is not None),
                                      key=lambda e: e.name)}


OBJECTIVES: dict[str, Objective] = _gather()
DEFAULT = "lm"  # objective.name when the section does not say
SPELLINGS = {  # a method's name that is not an entry's -> how this library spells it
    "sft": "for SFT set objective.name=lm with data.format=prompt_completion",
    "ipo": "for IPO set objective.name=dpo objective.loss=ipo",
}


def entry_of(cfg) -> Objective:
    """The OBJECTIVES entry of a RunConfig's objective section."""
    return OBJECTIVES[cfg.objective.name]


def build(cfg, tokenizer=None):
    """The step hooks of cfg's objective (its entry's build, from the RunConfig and the
    data's tokenizer: mlm never masks its eot_id); None before the data loads."""
    return entry_of(cfg).build(cfg, tokenizer)


def has_perplexity(cfg) -> bool:
    """Whether the run's validation loss has a perplexity (Objective.perplexity)."""
    return entry_of(cfg).perplexity


def needs_reference(cfg) -> bool:
    """Whether the steps take the init_from weights as their frozen reference (the
    entry's reference: DPO, GRPO with objective.beta > 0), without LoRA (with LoRA the
    base in the params is the reference)."""
    return entry_of(cfg).reference(cfg.objective) and not cfg.model.lora.rank


def reference_weights(cfg, initial):
    """The frozen reference the steps take (needs_reference), or None: a copy of the
    init_from weights `initial` in their own buffers (the train step donates the state's)."""
    if not needs_reference(cfg):
        return None
    return jax.tree.map(lambda x: jnp.array(x, copy=True), initial)


def step_records(cfg, metrics) -> dict:
    """A step's objective metrics (fetched to the host) as metrics.jsonl keys: the
    entry's metrics that the step gave."""
    return {k: float(np.mean(metrics[k])) for k in entry_of(cfg).metrics if k in metrics}


# ---- the objective section -----------------------------------------------------------


def settings(name: str = DEFAULT, **values):
    """The settings of objective `name` from its own keys (checked by its class)."""
    check_choice("objective", "name", name, OBJECTIVES)
    return OBJECTIVES[name].settings(**values)


def own_fields(entry: Objective) -> dict[str, dataclasses.Field]:
    """An entry's settings fields but its name."""
    return {f.name: f for f in dataclasses.fields(entry.settings) if f.name != "name"}


def owners(key: str) -> list[str]:
    """The objectives whose settings take objective.KEY."""
    return [name for name, entry in OBJECTIVES.items() if key in own_fields(entry)]


def foreign_default(key: str, value) -> bool:
    """Whether objective.KEY=value, a key of other objectives, holds one's default: what a
    saved run's config.yaml (before each objective owned its settings, every key of every
    objective was written) holds for the objectives it did not run."""
    for name in owners(key):
        field = own_fields(OBJECTIVES[name])[key]
        if coerce(value, type_names(OBJECTIVES[name].settings)[key],
                  f"objective.{key}") == field.default:
            return True
    return False


def settings_from(raw: Mapping[str, Any]):
    """The objective section (a mapping from YAML or key=value overrides) as its entry's
    settings: `name` (default lm) picks the entry, its keys are coerced to their types.
    A key of another objective is refused in one line naming the objectives that take it,
    unless it holds that default (an old run's full config.yaml); an unknown key too."""
    raw = dict(raw)
    name = raw.pop("name", DEFAULT)
    try:
        check_choice("objective", "name", name, OBJECTIVES)
    except ConfigError as e:
        hint = SPELLINGS.get(str(name).lower())
        raise ConfigError(f"{e}; {hint}" if hint else str(e)) from None
    entry = OBJECTIVES[name]
    own, types = own_fields(entry), type_names(entry.settings)
    values = {}
    for key, value in raw.items():
        if key in own:
            values[key] = coerce(value, types[key], f"objective.{key}")
        elif owners(key) and not foreign_default(key, value):
            raise ConfigError(f"objective.{key}={value} is not a setting of objective.name="
                              f"{name}; {key} is taken by objective.name "
                              f"{', '.join(owners(key))}")
        elif not owners(key):
            raise ConfigError(f"unknown key objective.{key}; objective.name={name} takes "
                              f"{', '.join(['name', *own])}")
    return entry.settings(**values)


def check_run(cfg) -> None:
    """The objective's model, data and starting weights in a RunConfig, each refused in
    one line; then the entry's own checks."""
    entry, name = entry_of(cfg), cfg.objective.name
    arch = cfg.model.arch
    if arch not in entry.batches:
        takes = [n for n, e in OBJECTIVES.items() if arch in e.batches]
        raise ConfigError(f"objective.name={name} with model.arch={arch}: {name} trains "
                          f"model.arch {', '.join(entry.archs)}; model.arch={arch} trains with "
                          f"objective.name {', '.join(takes) or 'none'}")
    check_data(entry, name, arch, cfg.data.format)
    if entry.starts_from and not cfg.train.init_from:
        raise ConfigError(f"objective.name={name} needs train.init_from: the model it starts "
                          "from (e.g. a fine-tuned run dir), its frozen reference where it "
                          "has one")
    check_loss_chunk(cfg)
    entry.check(cfg)


def check_loss_chunk(cfg) -> None:
    """model.loss_chunk (train.loss_chunk) with an objective whose hooks do not chunk their
    loss (its entry's loss_chunk False) is refused in one line naming those that do."""
    chunk, name = cfg.train.loss_chunk, cfg.objective.name
    if chunk and not entry_of(cfg).loss_chunk:
        takes = [n for n, e in OBJECTIVES.items() if e.loss_chunk]
        raise ConfigError(f"model.loss_chunk={chunk} with objective.name={name}: {name} "
                          "computes its loss from the whole logits; model.loss_chunk "
                          f"chunks objective.name {', '.join(takes) or 'none'}; set "
                          "model.loss_chunk=0")


def check_data(entry: Objective, name: str, arch: str, fmt: str) -> None:
    """data.format=fmt must give batches the objective trains model.arch=arch on: refused
    as the arch's fault where another arch of the objective takes them, else as the
    objective's."""
    batch = batches_of(fmt)
    if batch in entry.batches[arch]:
        return
    formats = ", ".join(formats_for(entry.batches[arch]))
    there = [a for a, kinds in entry.batches.items() if batch in kinds]
    if there:
        raise ConfigError(f"model.arch={arch} with data.format={fmt} and objective.name="
                          f"{name}: {name} trains on data.format={fmt} with model.arch "
                          f"{', '.join(there)}, and with model.arch={arch} on data.format "
                          f"{formats}")
    takes = [n for n, e in OBJECTIVES.items() if batch in e.batches.get(arch, ())]
    raise ConfigError(f"objective.name={name} with data.format={fmt}: {name} trains on "
                      f"data.format {formats}; data.format={fmt} trains with objective.name "
                      f"{', '.join(takes) or 'none'}")


__all__ = ["OBJECTIVES", "Objective", "build", "has_perplexity", "needs_reference",
           "reference_weights", "step_records", "settings", "settings_from", "check_run",
           "entry_of", "METRICS", "Preference", "answer_logps", "dpo_loss", "pair_terms"]
