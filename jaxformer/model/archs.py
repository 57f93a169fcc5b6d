"""What model.arch=encoder_decoder asks of the rest of a ModelConfig (jaxformer.model.config
reads this; the model is jaxformer.model.encoder_decoder).

An encoder-decoder has `encoder_layers` bidirectional blocks over the source and
`n_layers` causal blocks over the target, each of those with a cross-attention sublayer
after its self-attention (jaxformer.model.cross_attention). The block flow places that sublayer
(jaxformer.model.kinds.BlockFlow.cross); the parallel flows have no place for it. Plain math:
no Flax, no config import (config imports this).
"""

from __future__ import annotations

from jaxformer.core.validation import ConfigError
from jaxformer.model.kinds import BLOCKS
from jaxformer.positions.schemes import POSITION_SCHEMES

ENCODER_DECODER = "encoder_decoder"


def check_encoder_decoder(cfg) -> None:
    """One ConfigError line for a setting an encoder-decoder cannot run (or encoder_layers
    on a model without an encoder stack of its own)."""
    for key in ("encoder_layers", "tie_source_embed"):
        if cfg.arch != ENCODER_DECODER and getattr(cfg, key) not in (None, False):
            raise ConfigError(f"model.{key}={getattr(cfg, key)} needs model.arch="
                              f"{ENCODER_DECODER}; drop it for arch={cfg.arch}")
    if cfg.arch != ENCODER_DECODER:
        return
    with_cross = [n for n, f in BLOCKS.items() if f.cross is not None]
    refusals = (
        (BLOCKS[cfg.block].cross is None, f"model.block={cfg.block} has no place for the "
         f"cross-attention sublayer; use one of {', '.join(with_cross)}"),
        (cfg.tie_embeddings and cfg.tie_source_embed, "model.tie_source_embed=true unties "
         "nothing with tie_embeddings=true (source, target and head are one table already); "
         "drop it"),
        (cfg.mla.on, f"model.mla (latent attention) is not supported with model.arch="
         f"{ENCODER_DECODER}; set model.mla.kv_lora_rank=0"),
        (any(k.window is not None for k in cfg.kinds), "a sliding window (model.sliding_window "
         f"or a layer kind's window) is one-sided and not supported with model.arch="
         f"{ENCODER_DECODER}; drop the window"),
        (POSITION_SCHEMES[cfg.position].logits is not None, f"model.position={cfg.position} "
         f"(a contextual scheme) is not supported with model.arch={ENCODER_DECODER}; use "
         "another position scheme"),
    )
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)
