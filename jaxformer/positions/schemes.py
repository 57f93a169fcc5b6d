"""The positional schemes as a table: POSITION_SCHEMES, one PositionScheme per
`model.position` (jaxformer.positions.scheme), gathered from the modules of each kind,
where every entry sits beside its math and its settings class: rotary (rope, xpos),
biases (alibi, t5, fire, kerple, sandwich, ...), absolute (sinusoidal, learned) and cope.
Config validation, the model, the attention backends and the studies read it; a new
scheme is one entry in its kind's module, and the property tests parametrised over the
table test it.

A scheme's own hyperparameters are its settings (PositionSettings), model.position_settings:
``model.position=t5 model.position_settings.num_buckets=64``. LEGACY_KEYS maps the flat
model keys of earlier versions (model.t5_num_buckets) to the scheme and field that now
hold each (jaxformer.model.config reads them into position_settings).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn

from jaxformer.core.validation import ConfigError
from jaxformer.positions import absolute, biases, cope, rotary
from jaxformer.positions.absolute import SINUSOIDAL_SCALES, sinusoidal_terms  # noqa: F401
from jaxformer.positions.biases import _kerple_bias, fire_bias  # noqa: F401
from jaxformer.positions.scheme import (KINDS, OWNER, LogitBias,  # noqa: F401
                                        PositionScheme, PositionSettings, dense_bias)

POSITION_SCHEMES: dict[str, PositionScheme] = {
    s.name: s for s in (*rotary.SCHEMES, *biases.SCHEMES, *absolute.SCHEMES, *cope.SCHEMES,
                        PositionScheme("none", "none"))}

# a flat model key of earlier versions -> (the scheme whose setting it is, that field)
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    old: (name, field) for name, s in POSITION_SCHEMES.items()
    for old, field in s.settings.LEGACY.items()}


def schemes_of(kind: str) -> list[str]:
    """The names of the schemes of one kind, in table order."""
    return [name for name, s in POSITION_SCHEMES.items() if s.kind == kind]


def read_settings(position: str, given, legacy: Mapping[str, Any]) -> PositionSettings:
    """The settings of scheme `position` from `given` (model.position_settings: None, a
    mapping, an instance) and `legacy`, the values of LEGACY_KEYS' flat model keys (None:
    unset). The chosen scheme's flat keys become its settings; another scheme's pass at
    that scheme's default (a saved run's config.yaml holds them all) and are refused
    otherwise, in one line naming the new key."""
    if isinstance(given, Mapping):
        given = dict(given)
    for old, value in legacy.items():
        name, field = LEGACY_KEYS[old]
        if value is None:
            continue
        default = {f.name: f.default for f in dataclasses.fields(POSITION_SCHEMES[name].settings)}
        if name == position and isinstance(given, (dict, type(None))):
            given = dict(given or {})
            if given.setdefault(field, value) != value:
                raise ConfigError(f"model.{old}={value!r} and {OWNER}.{field}={given[field]!r} "
                                  f"disagree; drop model.{old} (now {OWNER}.{field})")
        elif name == position or value != default[field]:
            raise ConfigError(f"model.{old} is now {OWNER}.{field} (with model.position={name}); "
                              f"got {value!r} with model.position={position!r}")
    return POSITION_SCHEMES[position].settings.read(given, position)


def check_position(cfg) -> None:
    """What the scheme of model config `cfg` refuses of it, in one ConfigError line: its
    own check, and an arch without the causal rule where it is causal_only."""
    scheme = POSITION_SCHEMES[cfg.position]
    if scheme.check is not None:
        scheme.check(cfg)
    if scheme.causal_only and not cfg.causal:
        both = [n for n, s in POSITION_SCHEMES.items() if not s.causal_only]
        raise ConfigError(f"model.position={cfg.position!r} is defined for causal attention "
                          f"only, not model.arch={cfg.arch!r}; use one of {', '.join(both)}")


class PositionBias(nn.Module):
    """The attention-logit bias of the position scheme as a LogitBias, shared by every
    layer (as T5 does), or None for a scheme without one.

    Keys may be cache slots: an empty slot's far-future position gives a finite bias that
    the mask then hides."""

    cfg: Any

    @nn.compact
    def __call__(self):
        make = POSITION_SCHEMES[self.cfg.position].bias
        return None if make is None else make(self, self.cfg)
