"""objective.name=lm: next-token cross entropy on the loss mask (pretraining on a corpus,
prompt/completion fine-tuning; training/step.py's loss, with MoE balancing and LoRA
sweeps), or, for model.arch=encoder_decoder, the target's cross entropy with
optim.label_smoothing (training/seq2seq.py). It takes no setting of its own."""

from __future__ import annotations

import dataclasses

from jaxformer.model.archs import ARCHS, ENCODER_DECODER
from jaxformer.training.objectives.entry import Objective, fixed_name
from jaxformer.training.seq2seq import Seq2Seq
from jaxformer.training.step import LanguageModel


@dataclasses.dataclass(frozen=True)
class LMSettings:
    """objective.name=lm: no setting beside the name."""

    name: str = fixed_name("lm")


def build(cfg, tokenizer=None):
    """The step hooks: the encoder-decoder's (Seq2Seq) or the decoder's (LanguageModel)."""
    if ARCHS[cfg.model.arch].encoder:  # an encoder stack of its own: source/target pairs
        return Seq2Seq(cfg.optim.label_smoothing)
    return LanguageModel(cfg.optim.grad_accum)


ENTRY = Objective(settings=LMSettings, build=build,
                  batches={"decoder": ("tokens", "completions"),
                           ENCODER_DECODER: ("sources",)})
