"""objective.name=mlm: BERT's masked language model for model.arch=encoder (the loss and
its corruption: training/mlm.py). Settings: mask_rate, the share of tokens chosen (80%
masked, 10% a random token, 10% kept), in (0, 1); mask_id, the id of the mask (None:
model.vocab_size - 1, reserved for it), below model.vocab_size."""

from __future__ import annotations

import dataclasses

from jaxformer.core.validation import ConfigError, check_number
from jaxformer.training.mlm import MaskedLM
from jaxformer.training.objectives.entry import Objective, fixed_name


@dataclasses.dataclass(frozen=True)
class MLMSettings:
    """objective.name=mlm: mask_rate in (0, 1), mask_id >= 0 or None."""

    name: str = fixed_name("mlm")
    mask_rate: float = 0.15
    mask_id: int | None = None

    def __post_init__(self):
        check_number("objective", "mask_rate", self.mask_rate, float, low=0, low_open=True,
                     high=1, high_open=True)
        check_number("objective", "mask_id", self.mask_id, int, low=0, optional=True)


def check(cfg) -> None:
    """The mask id must be a token of the model's vocabulary."""
    mask_id = cfg.objective.mask_id
    if mask_id is not None and mask_id >= cfg.model.vocab_size:
        raise ConfigError(f"objective.mask_id={mask_id} must be below model.vocab_size="
                          f"{cfg.model.vocab_size}")


ENTRY = Objective(settings=MLMSettings, build=MaskedLM.of,  # the masked tokens' cross entropy
                  batches={"encoder": ("tokens", "completions")}, check=check,
                  loss_chunk=True)  # model.loss_chunk: the head and loss a block at a time
