"""model.layer_kinds' rows (LayerKind: one kind of layer in a model's layer pattern, its window,
RoPE and mixer) and the checks of a pattern as a whole (read by jaxformer.model.config)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxformer.core.validation import (ConfigError, Section, check_choice, check_number,
                                       coerce, type_names)
from jaxformer.model.archs import ARCHS
from jaxformer.model.kinds import BLOCKS
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
    (false: Mamba-2's and Nemotron-H's mixer-only layers). parallel: a recurrent mixer
    run beside the attention on the same normed input, its output added (Falcon-H1's
    attention and Mamba-2; params `parallel_mixer`, its state in the layer's cache beside
    the keys). mixer_in_multiplier, mixer_out_multiplier: the kind's mixer's input and
    output scaled (Falcon-H1's attention_in/out_multiplier); ffn_gate_multiplier,
    ffn_out_multiplier: the FFN's gate before its activation, and its output (Falcon-H1's
    mlp_multipliers).
    chunk: attention within chunks of this many positions, a key seen only in the query's
    own chunk (position // chunk equal: Llama 4's chunked local attention); the kind's
    window is then the chunk (set no wider). qk_norm: false skips the model's QK-norm in
    this kind's layers (Llama 4 norms its RoPE layers alone). temperature_floor,
    temperature_scale: the queries at position p times 1 + temperature_scale *
    log(1 + floor((p + 1) / temperature_floor)) (Llama 4's attention temperature tuning
    of its NoPE layers: floor_scale, attn_scale); None: not scaled.
    """

    window: int | None = None
    rope: bool = True
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    mixer: str = ATTENTION
    ffn: bool = True
    parallel: str | None = None
    mixer_in_multiplier: float = 1.0
    mixer_out_multiplier: float = 1.0
    ffn_gate_multiplier: float = 1.0
    ffn_out_multiplier: float = 1.0
    chunk: int | None = None
    qk_norm: bool = True
    temperature_floor: int | None = None
    temperature_scale: float = 0.0

    SECTION = "layer_kinds.<kind>"

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        check_number(self.SECTION, "window", self.window, int, low=1, optional=True)
        self._check_chunk()
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{self.SECTION}.{name}={getattr(self, name)!r} must be true "
                                  "or false")
        check_choice(self.SECTION, "mixer", self.mixer, MIXERS)
        if self.parallel is not None:
            check_choice(self.SECTION, "parallel", self.parallel, MIXERS)
        for name in MULTIPLIERS:
            check_number(self.SECTION, name, getattr(self, name), float)
        check_number(self.SECTION, "rope_theta", self.rope_theta, float, low=1, low_open=True,
                     optional=True)


    def _check_chunk(self):
        """A chunk is the kind's window too (none wider); the temperature's floor."""
        check_number(self.SECTION, "chunk", self.chunk, int, low=1, optional=True)
        check_number(self.SECTION, "temperature_floor", self.temperature_floor, int, low=1,
                     optional=True)
        check_number(self.SECTION, "temperature_scale", self.temperature_scale, float)
        if self.chunk is None:
            return
        if self.window is not None and self.window > self.chunk:
            raise ConfigError(f"{self.SECTION}.window={self.window} is wider than its "
                              f"chunk={self.chunk}, which already hides every key farther "
                              "back; leave the window unset")
        object.__setattr__(self, "window", self.window or self.chunk)


MULTIPLIERS = ("mixer_in_multiplier", "mixer_out_multiplier", "ffn_gate_multiplier",
               "ffn_out_multiplier")  # LayerKind's, 1.0: none


def read_pattern(pattern, kinds) -> tuple[tuple[str, ...], tuple[tuple[str, LayerKind], ...]]:
    """model.layer_pattern as a tuple of names ('local,global' from the command line) and
    model.layer_kinds as a hashable tuple of (name, LayerKind), from mappings of values."""
    if isinstance(pattern, str):
        pattern = [p.strip() for p in pattern.split(",") if p.strip()]
    fields = type_names(LayerKind)
    if isinstance(kinds, str) and not kinds.strip():  # model.layer_kinds= clears them
        kinds = None
    if isinstance(kinds, Mapping):
        kinds = kinds.items()
    elif kinds is not None and not (isinstance(kinds, (list, tuple)) and all(
            isinstance(k, (list, tuple)) and len(k) == 2 for k in kinds)):
        raise ConfigError(f"model.layer_kinds={kinds!r} must be a mapping of kind names to "
                          f"their fields ({', '.join(fields)}); on the command line set one "
                          "field at a time: model.layer_kinds.NAME.FIELD=VALUE")
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


def layer_parallels(cfg) -> tuple[str | None, ...]:
    """Each layer's parallel mixer (a recurrent mixer beside its attention), or None:
    ModelConfig.layer_parallels."""
    return tuple(cfg.kinds[i].parallel for i in cfg.layer_kind_ids)


def layer_forms(cfg) -> tuple[tuple[str, bool, str | None], ...]:
    """Each layer's (mixer, ffn, parallel mixer): with its FFN's sparsity, what decides its
    structure (ModelConfig.layer_runs)."""
    return tuple((k.mixer, k.ffn, k.parallel) for k in (cfg.kinds[i] for i in cfg.layer_kind_ids))


def check_pattern(cfg, scheme):
    """The layer pattern names kinds that exist, each used; windows per kind replace
    sliding_window; RoPE settings per kind need a rotary scheme."""
    names = [n for n, _ in cfg.layer_kinds]
    if not cfg.layer_pattern:
        if names:
            raise ConfigError(f"model.layer_kinds ({', '.join(names)}) needs model."
                              "layer_pattern, the kinds' order over the layers")
        return
    unknown = sorted(set(cfg.layer_pattern) - set(names))
    if unknown:
        raise ConfigError(f"model.layer_pattern names {', '.join(map(repr, unknown))}, not in "
                          f"model.layer_kinds ({', '.join(names) or 'none defined'})")
    unused = [n for n in names if n not in cfg.layer_pattern]
    if unused:
        raise ConfigError(f"model.layer_kinds {', '.join(map(repr, unused))} not used by "
                          f"model.layer_pattern={list(cfg.layer_pattern)}")
    if len(cfg.layer_pattern) > cfg.n_layers:
        raise ConfigError(f"model.layer_pattern has {len(cfg.layer_pattern)} entries, more "
                          f"than model.n_layers={cfg.n_layers}")
    if cfg.sliding_window is not None:
        raise ConfigError(f"model.sliding_window={cfg.sliding_window} with a layer_pattern: "
                          "set each kind's window in model.layer_kinds instead")
    for name, kind in cfg.layer_kinds:
        own = [n for n in ("window", "rope_theta", "rope_scaling") if getattr(kind, n)]
        if MIXERS[kind.mixer].recurrent and own:
            raise ConfigError(f"model.layer_kinds.{name} sets {', '.join(own)}, which a "
                              f"{kind.mixer} layer has no use for (it reads no positions "
                              "and has no window); set them on an attention layer's kind")
        rope_set = not kind.rope or kind.rope_theta is not None or kind.rope_scaling is not None
        if rope_set and scheme.kind != "rotary":
            raise ConfigError(f"model.layer_kinds.{name} sets RoPE (rope, rope_theta or "
                              f"rope_scaling), which needs a rotary position scheme, not "
                              f"position={cfg.position!r}")


def check_mixers(cfg, scheme):
    """Recurrent layers: settings given for mixers the layers use, a causal arch, and a
    position scheme that acts in attention only where some layer attends."""
    for name, kind in cfg.layer_kinds:
        check_parallel(name, kind)
    used = set(cfg.layer_mixers) | {p for p in cfg.layer_parallels if p}
    unused = [n for n, _ in cfg.mixer if n not in used]
    if unused:
        raise ConfigError(f"model.mixer.{unused[0]} is set but no layer kind has "
                          f"mixer={unused[0]} (model.layer_kinds.<kind>.mixer)")
    if not cfg.recurrent:
        return
    if not cfg.causal or ARCHS[cfg.arch].cross_attention:
        raise ConfigError(f"model.arch={cfg.arch} with recurrent layers "
                          f"({', '.join(sorted(m for m in used if MIXERS[m].recurrent))}): "
                          "they run left to "
                          "right; use model.arch=decoder")
    acts = scheme.rotate or scheme.bias or scheme.logits
    if acts and not any(MIXERS[m].mixes and not MIXERS[m].recurrent for m in used):
        raise ConfigError(f"model.position={cfg.position!r} acts in attention layers, and "
                          f"every layer's mixer here is {', '.join(sorted(used))}; use "
                          "model.position=none (or an absolute scheme)")


def check_parallel(name: str, kind: LayerKind):
    """A kind's parallel mixer: recurrent, beside an attention mixer."""
    if kind.parallel is None:
        return
    if not MIXERS[kind.parallel].recurrent:
        recurrent = ", ".join(n for n, m in MIXERS.items() if m.recurrent)
        raise ConfigError(f"model.layer_kinds.{name}.parallel={kind.parallel} must be a "
                          f"recurrent mixer ({recurrent})")
    if MIXERS[kind.mixer].recurrent or not MIXERS[kind.mixer].mixes:
        raise ConfigError(f"model.layer_kinds.{name}.parallel={kind.parallel} runs beside "
                          f"attention, not mixer={kind.mixer}; set mixer: attention")


def check_layer_forms(cfg):
    """A layer kind without an FFN or without a mixer needs its block's form for it; a
    kind's FFN gate multiplier needs a dense FFN's gate."""
    for i, sparse in zip(cfg.layer_kind_ids, cfg.sparse_layers):
        name, kind = cfg.layer_kinds[i] if cfg.layer_kinds else ("", cfg.kinds[0])
        if sparse and kind.ffn_gate_multiplier != 1:
            raise ConfigError(f"model.layer_kinds.{name}.ffn_gate_multiplier="
                              f"{kind.ffn_gate_multiplier} scales a dense FFN's gate, and the "
                              "mixture of experts (model.moe) has none; leave it 1")
    for name, kind in cfg.layer_kinds:
        mixes = MIXERS[kind.mixer].mixes
        form = "mixer_only" if not kind.ffn else None if mixes else "ffn_only"
        if not kind.ffn and not mixes:
            raise ConfigError(f"model.layer_kinds.{name} has neither a mixer (mixer=none) "
                              "nor a feed-forward network (ffn=false)")
        if form and getattr(BLOCKS[cfg.block], form) is None:
            raise ConfigError(
                f"model.block={cfg.block} has no form for model.layer_kinds.{name} "
                f"({'ffn=false' if form == 'mixer_only' else 'mixer=none'}); use model.block="
                + " or ".join(n for n, b in BLOCKS.items() if getattr(b, form)))
