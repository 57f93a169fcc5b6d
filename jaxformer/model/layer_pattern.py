"""model.layer_kinds' rows: LayerKind, one kind of layer in a model's layer pattern (read
by jaxformer.model.config.ModelConfig, which resolves each kind's RoPE from the model's)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxformer.core.validation import (ConfigError, Section, check_choice, check_number,
                                       coerce, type_names)
from jaxformer.model.mixers import ATTENTION, MIXERS
from jaxformer.positions.rope_scaling import RopeScaling


@dataclasses.dataclass(frozen=True)
class LayerKind(Section):
    """One kind of layer in a model's layer pattern (model.layer_kinds): what its
    attention sees and how its queries and keys are rotated.

    window: the sliding window of its attention (None: every earlier key).
    rope: False makes it a NoPE layer (nothing rotated; a rotary position scheme only).
    rope_theta, rope_scaling: this kind's RoPE base and scaling; None: the model's.
    mixer: what mixes its tokens (jaxformer.model.mixers.MIXERS): attention, or a recurrent
    layer (gated_delta, mamba2, short_conv: its settings in model.mixer.<name>), which has
    no window and no RoPE. ffn: the layer has a feed-forward network after its mixer
    (false: Mamba-2's and Nemotron-H's mixer-only layers).
    """

    window: int | None = None
    rope: bool = True
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    mixer: str = ATTENTION
    ffn: bool = True

    SECTION = "layer_kinds.<kind>"

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        check_number(self.SECTION, "window", self.window, int, low=1, optional=True)
        for name in ("rope", "ffn"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{self.SECTION}.{name}={getattr(self, name)!r} must be true "
                                  "or false")
        check_choice(self.SECTION, "mixer", self.mixer, MIXERS)
        check_number(self.SECTION, "rope_theta", self.rope_theta, float, low=1, low_open=True,
                     optional=True)


def read_pattern(pattern, kinds) -> tuple[tuple[str, ...], tuple[tuple[str, LayerKind], ...]]:
    """model.layer_pattern as a tuple of names ('local,global' from the command line) and
    model.layer_kinds as a hashable tuple of (name, LayerKind), from mappings of values."""
    if isinstance(pattern, str):
        pattern = [p.strip() for p in pattern.split(",") if p.strip()]
    if isinstance(kinds, Mapping):
        kinds = kinds.items()
    fields = type_names(LayerKind)
    read = []
    for name, kind in kinds or ():
        if isinstance(kind, Mapping):
            bad = sorted(set(kind) - set(fields))
            if bad:
                raise ConfigError(f"unknown key(s) {', '.join(f'model.layer_kinds.{name}.{b}' for b in bad)}; "
                                  f"valid keys are: {', '.join(fields)}")
            kind = LayerKind(**{k: v if k == "rope_scaling" else
                                coerce(v, fields[k], f"model.layer_kinds.{name}.{k}")
                                for k, v in kind.items()})
        elif not isinstance(kind, LayerKind):
            raise ConfigError(f"model.layer_kinds.{name}={kind!r} must be a mapping of "
                              f"{', '.join(fields)}")
        read.append((str(name), kind))
    return tuple(pattern or ()), tuple(read)
