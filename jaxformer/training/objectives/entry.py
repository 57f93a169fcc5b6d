"""What an objective declares (one entry of jaxformer.training.objectives.OBJECTIVES): its
settings, its step hooks, the model and batches it trains, what it logs, and whether it
has a perplexity, a frozen reference, rollouts. The run config and the loop ask these;
no code compares an objective's name.

The step hooks an entry builds share one interface (Hooks; training/step.py calls it).
An entry that rolls out (GRPO) builds hooks with rollout_step(model, data, reference,
mesh, rules, shardings) -> its train step(state, step index), and eval_sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from jaxformer.core.validation import ConfigError
from jaxformer.data.formats import FORMATS

def batches_of(data_format: str) -> str:
    """What the batches of data.format=data_format hold, as an objective's `batches` names
    them (jaxformer.data.formats.FORMATS[...].batch): tokens (a corpus), completions
    (prompt and completion records, the loss on the completion; their prompts are what GRPO
    samples from), pairs (a chosen and a rejected answer side by side), sources
    (source/target pairs of an encoder-decoder)."""
    return FORMATS[data_format].batch


def formats_for(batches) -> list[str]:
    """The data.format names whose batches are one of `batches`."""
    return [name for name, f in FORMATS.items() if f.batch in batches]


class Hooks(Protocol):
    """What training/step.py calls on an objective's hooks."""

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        """(summed loss, count, gradient of the summed loss w.r.t. trained, metric sums)."""

    def eval_sums(self, model, params, batch, reference=None):
        """(summed loss, count) or (summed loss, count, metric sums) of a val batch."""

    def metrics(self, sums, count) -> dict:
        """A step's metrics from its sums: the entry's `metrics` names."""


@dataclasses.dataclass(frozen=True)
class Objective:
    """One objective.name's entry.

    settings: its settings class, a frozen dataclass of the objective section's keys it
      takes (a `name` field fixed to the entry's, the rest its own, each checked with a
      one-line error); objective.KEY of another objective is refused (training/config).
    build: (cfg, tokenizer) -> the step hooks (Hooks) for a RunConfig and
      the data's tokenizer (None before the data loads: a bad setting is refused early).
    archs: the model.arch values it trains; batches: what its batches hold (batches_of
      each data.format), by arch: {arch: (batches, ...)}.
    metrics: the names its train step logs beside loss (metrics.jsonl; val_NAME at
      evaluation where eval_sums gives them).
    perplexity: whether its validation loss is a mean per-token cross entropy whose exp
      is a perplexity (the run logs val_ppl).
    reference: settings -> whether its steps read the frozen train.init_from weights (a
      copy, or with LoRA the base without its adapters).
    starts_from: whether it needs train.init_from (the model it post-trains).
    rollout: whether its hooks roll out (rollout_step is the train step; the loop hands
      it the step index, not a batch).
    check: (RunConfig) -> None, its own refusals across sections (one-line ConfigError).
    loss_chunk: whether its hooks apply model.loss_chunk (the head and cross entropy a
      block of positions at a time: training/chunked_loss.py); where not, a run that sets
      it is refused in one line (objectives.check_run), not trained with the full logits.
    """

    settings: type
    build: Callable[[Any, Any], Hooks]
    batches: dict[str, tuple[str, ...]]
    metrics: tuple[str, ...] = ()
    perplexity: bool = True
    reference: Callable[[Any], bool] = lambda settings: False
    starts_from: bool = False
    rollout: bool = False
    check: Callable[[Any], None] = lambda cfg: None
    loss_chunk: bool = False

    @property
    def name(self) -> str:
        """objective.name: its settings' fixed `name`."""
        return {f.name: f.default for f in dataclasses.fields(self.settings)}["name"]

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(self.batches)


def fixed_name(name: str):
    """A settings class's `name` field: dumped with its settings, set by the entry alone."""
    return dataclasses.field(default=name, init=False)


def dense_only(cfg, *, grad_accum: bool = False) -> None:
    """Refuse MoE layers and LoRA sweeps (and, with grad_accum, optim.grad_accum > 1) for
    cfg's objective, in one line."""
    m, name = cfg.model, cfg.objective.name
    if any(m.sparse_layers) or len(m.lora.members()) > 1 or (
            grad_accum and cfg.optim.grad_accum > 1):
        accum = (" and optim.grad_accum=1", " and optim.grad_accum") if grad_accum else ("", "")
        raise ConfigError(f"objective.name={name} trains a dense model with one adapter or "
                          f"none{accum[0]}; drop model.lora.sweep_*, the MoE layers{accum[1]}, "
                          "or use objective.name=lm")
