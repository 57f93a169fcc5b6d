"""The mixer kinds: what mixes a layer's tokens, one row per value of a layer kind's
`mixer` (model.layer_kinds.<kind>.mixer): attention, or a recurrent layer with a
fixed-size state (gated_delta, mamba2, short_conv). Each recurrent row owns its settings
(model.mixer.<name>, a frozen Section), its Flax module and the shapes of its decode
cache. A module here imports no ModelConfig (it reads the config's fields), so the config
reads this table without a circle.

A recurrent module is called as module(cfg, settings, name="mixer")(x [B, T, D],
segment_ids [B, T] or None, cache or None) -> y [B, T, D], or (y, cache) with a cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxformer.core.validation import ConfigError, Section, coerce, type_names
from jaxformer.model.mixers import gated_delta, mamba2, short_conv


@dataclasses.dataclass(frozen=True)
class Mixer:
    """settings: its settings class (model.mixer.<name>); None: attention, whose settings
    are the model's own fields. module: the Flax module (None: the model's attention).
    cache(cfg, settings) -> {name: (shape of one batch row's entry, float32 or None for
    the model's dtype)}: its layer's decode cache, whatever the length. flops(cfg,
    settings, seq_len) -> its training FLOPs per token (jaxformer.model.transformer's
    flops_per_token counts attention's itself). mixes: False for
    `none`, a layer of its feed-forward network alone (Nemotron-H's MLP layers)."""

    settings: type | None = None
    module: Callable | None = None
    cache: Callable | None = None
    flops: Callable | None = None
    mixes: bool = True

    @property
    def recurrent(self) -> bool:
        return self.module is not None


MIXERS: dict[str, Mixer] = {
    "attention": Mixer(),
    "none": Mixer(mixes=False),
    "gated_delta": Mixer(gated_delta.GatedDeltaSettings, gated_delta.GatedDeltaMixer,
                         gated_delta.cache_shapes, gated_delta.flops),
    "mamba2": Mixer(mamba2.Mamba2Settings, mamba2.Mamba2Mixer, mamba2.cache_shapes, mamba2.flops),
    "short_conv": Mixer(short_conv.ShortConvSettings, short_conv.ShortConvMixer,
                        short_conv.cache_shapes, short_conv.flops),
}
ATTENTION = "attention"  # a layer kind's mixer when it names none
# the mixer settings that say how a mixer runs, not what it computes (its settings class's
# RUNTIME: a chunk length), as setting_fields names them
MIXER_RUNTIME = tuple(f"mixer.{name}.{key}" for name, m in MIXERS.items()
                      if m.settings is not None for key in getattr(m.settings, "RUNTIME", ()))


def setting_fields(cfg) -> dict[str, Any]:
    """A model config's to_dict() with model.mixer as one field per setting of each mixer
    its layers run (mixer.NAME.KEY, defaults filled in): two configs compare setting by
    setting, a mixer's RUNTIME ones (MIXER_RUNTIME) told from the rest, an unwritten
    default equal to a written one."""
    out = cfg.to_dict()
    out.pop("mixer")
    for name in sorted({m for m in cfg.layer_mixers + cfg.layer_parallels if m}):
        if (settings := settings_of(cfg.mixer, name)) is not None:
            out |= {f"mixer.{name}.{k}": v for k, v in dataclasses.asdict(settings).items()}
    return out


def changed_settings(cfg, other, allowed=()) -> list[tuple[str, Any, Any]]:
    """(field, cfg's value, other's) for each setting_fields field, but those in `allowed`,
    where the two model configs differ, in the fields' order."""
    a, b = setting_fields(cfg), setting_fields(other)
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b])
            if k not in allowed and a.get(k) != b.get(k)]


def read_mixer_settings(raw) -> tuple[tuple[str, Any], ...]:
    """model.mixer ({name: settings or a mapping of its fields}) as a hashable tuple of
    (name, settings), every recurrent mixer's name a key of MIXERS."""
    if isinstance(raw, (tuple, list)):  # its own form, or that form as YAML wrote it
        raw = dict(raw)
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"model.mixer={raw!r} must be a mapping of a recurrent mixer's name "
                          f"to its settings ({', '.join(recurrent_names())})")
    read = []
    for name, value in raw.items():
        if name not in MIXERS or not MIXERS[name].recurrent:
            raise ConfigError(f"unknown key model.mixer.{name}; its keys are the recurrent "
                              f"mixers: {', '.join(recurrent_names())}")
        cls = MIXERS[name].settings
        if isinstance(value, Mapping):
            fields = type_names(cls)
            bad = sorted(set(value) - set(fields))
            if bad:
                raise ConfigError(f"unknown key(s) {', '.join(f'model.mixer.{name}.{b}' for b in bad)}"
                                  f"; valid keys are: {', '.join(fields)}")
            value = cls(**{k: coerce(v, fields[k], f"model.mixer.{name}.{k}")
                           for k, v in value.items()})
        elif value is None:
            value = cls()
        elif not isinstance(value, cls):
            raise ConfigError(f"model.mixer.{name}={value!r} must be a mapping of "
                              f"{', '.join(type_names(cls))}")
        read.append((str(name), value))
    return tuple(read)


def recurrent_names() -> list[str]:
    return [n for n, m in MIXERS.items() if m.recurrent]


def settings_of(settings: tuple[tuple[str, Any], ...], name: str) -> Section | None:
    """The settings of mixer `name` among model.mixer's, its defaults where not given
    (None for attention)."""
    cls = MIXERS[name].settings
    return dict(settings).get(name, cls() if cls is not None else None)
