"""The absolute schemes, terms added to the token embeddings: sinusoidal (Vaswani et al.
2017's table, its scale a setting) and learned (a table of max_seq_len rows)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxformer.core.sharding import init_with_names
from jaxformer.core.validation import check_choice
from jaxformer.positions.formulas import sinusoidal
from jaxformer.positions.scheme import OWNER, PositionScheme, PositionSettings, even

# model.position_settings.scale: (the table / sqrt(d_model), the tokens * sqrt(d_model))
SINUSOIDAL_SCALES = {"table": (True, False), "tokens": (False, True), "unit": (False, False)}


@dataclasses.dataclass(frozen=True)
class SinusoidalSettings(PositionSettings):
    """scale (SINUSOIDAL_SCALES): how the unit-amplitude table meets token embeddings
    initialised at std 0.02. table: the table / sqrt(d_model), the token-to-position ratio
    of Vaswani et al.'s embeddings * sqrt(d_model) with the embeddings left as they are;
    tokens: Vaswani et al.'s form, embeddings * sqrt(d_model) + table; unit: the table as
    is (its RMS of 0.71 per dimension swamps the tokens ~35:1)."""

    scale: str = "table"

    LEGACY: ClassVar = {"sinusoidal_scale": "scale"}

    def __post_init__(self):
        check_choice(OWNER, "scale", self.scale, SINUSOIDAL_SCALES)


def sinusoidal_terms(cfg, x, positions):
    """Token embeddings x [B, T, D] and the sinusoidal table, scaled as
    cfg.position_settings.scale says; the input is their sum."""
    table = sinusoidal(positions, cfg.d_model, dtype=jnp.float32)
    root = jnp.float32(np.sqrt(cfg.d_model))
    shrink_table, grow_tokens = SINUSOIDAL_SCALES[cfg.position_settings.scale]
    if shrink_table:
        table = table / root
    if grow_tokens:
        x = x * root.astype(x.dtype)
    return x, table.astype(x.dtype)


def _sinusoidal(module, cfg, x, positions):
    return sinusoidal_terms(cfg, x, positions)


def _learned(module, cfg, x, positions):
    table = nn.Embed(cfg.max_seq_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=init_with_names(nn.initializers.normal(0.01), "table",
                                                    "embed"), name="pos_embed")
    return x, table(positions)


SCHEMES = (
    PositionScheme("sinusoidal", "absolute", embed=_sinusoidal, settings=SinusoidalSettings,
                   check=even("d_model", "sinusoidal positions pair sin and cos and need an "
                              "even d_model")),
    PositionScheme("learned", "absolute", embed=_learned, max_length=lambda cfg: cfg.max_seq_len),
)
