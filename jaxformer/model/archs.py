"""model.arch as a table: ARCHS, one Arch per shape of model, owning what differs between
them (the causal rule, generation, the module that builds it, an encoder stack read by
cross-attention, and what each refuses of the rest of a ModelConfig). The code asks the
entry (``ARCHS[cfg.arch].causal``), never the name. Plain data and checks: no Flax, no
config import (config imports this); jaxformer.model.build maps `module` to the class.

An encoder-decoder has `encoder_layers` bidirectional blocks over the source and
`n_layers` causal blocks over the target, each of those with a cross-attention sublayer
after its self-attention (jaxformer.model.cross_attention). The block flow places that
sublayer (jaxformer.model.kinds.BlockFlow.cross); the parallel flows have no place for it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxformer.core.validation import ConfigError
from jaxformer.model.kinds import BLOCKS
from jaxformer.positions.schemes import POSITION_SCHEMES

ENCODER_DECODER = "encoder_decoder"  # its name, for the Hugging Face rows that build one
ONE_STACK_ONLY = ("encoder_layers", "tie_source_embed")  # fields of a model with an encoder


@dataclasses.dataclass(frozen=True)
class Arch:
    """One model.arch.

    causal: its self-attention has the causal rule (an encoder-decoder: its decoder's);
      the masks and the T5 buckets read it (ModelConfig.causal).
    generates: it decodes token by token with a KV cache (ModelConfig.generates).
    module: the name of the flax module class that builds it (jaxformer.model.build.MODELS).
    encoder: the arch of an encoder stack of its own that its decoder's cross-attention
      reads (a source side: seq2seq data, the encoder-decoder's loss), or None for a
      single stack; `cross_attention` says whether it has one.
    check(cfg): one ConfigError line for a setting it cannot run.
    """

    causal: bool
    generates: bool
    module: str
    check: Callable
    encoder: str | None = None

    @property
    def cross_attention(self) -> bool:
        """An encoder stack read by the decoder's cross-attention (an encoder-decoder)."""
        return self.encoder is not None


def _check_one_stack(cfg) -> None:
    """A single stack refuses the fields only a model with an encoder stack has."""
    for key in ONE_STACK_ONLY:
        if getattr(cfg, key) not in (None, False):
            with_encoder = [n for n, a in ARCHS.items() if a.cross_attention]
            raise ConfigError(f"model.{key}={getattr(cfg, key)} needs model.arch="
                              f"{' or '.join(with_encoder)}; drop it for arch={cfg.arch}")


def check_encoder_decoder(cfg) -> None:
    """One ConfigError line for a setting an encoder-decoder cannot run."""
    with_cross = [n for n, f in BLOCKS.items() if f.cross is not None]
    refusals = (
        (BLOCKS[cfg.block].cross is None, f"model.block={cfg.block} has no place for the "
         f"cross-attention sublayer; use one of {', '.join(with_cross)}"),
        (cfg.tie_embeddings and cfg.tie_source_embed, "model.tie_source_embed=true unties "
         "nothing with tie_embeddings=true (source, target and head are one table already); "
         "drop it"),
        (cfg.mla.on, f"model.mla (latent attention) is not supported with model.arch="
         f"{cfg.arch}; set model.mla.kv_lora_rank=0"),
        (any(k.window is not None for k in cfg.kinds), "a sliding window (model.sliding_window "
         f"or a layer kind's window) is one-sided and not supported with model.arch="
         f"{cfg.arch}; drop the window"),
        (POSITION_SCHEMES[cfg.position].logits is not None, f"model.position={cfg.position} "
         f"(a contextual scheme) is not supported with model.arch={cfg.arch}; use "
         "another position scheme"),
    )
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


ARCHS: dict[str, Arch] = {
    "decoder": Arch(causal=True, generates=True, module="Transformer", check=_check_one_stack),
    "encoder": Arch(causal=False, generates=False, module="Transformer", check=_check_one_stack),
    ENCODER_DECODER: Arch(causal=True, generates=True, module="EncoderDecoder",
                          check=check_encoder_decoder, encoder="encoder"),
}
