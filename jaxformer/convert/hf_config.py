"""ModelConfig -> a Hugging Face config.json: the model type that writes a model is the first
row (jaxformer.hf.families, by export rank) whose config.json, read back, is the same model.
Its writer writes what it can; the round trip finds what the type cannot say, and a model
that no type writes is a ConfigError naming the fields of the nearest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxformer.hf.config_json import config_from_hf
from jaxformer.hf.families import MODEL_TYPES, HFModelType
from jaxformer.model.archs import ARCHS
from jaxformer.model.config import RUNTIME, ConfigError, ModelConfig
from jaxformer.moe.experts import ROUTERS
from jaxformer.positions.schemes import POSITION_SCHEMES

_PER_LAYER = ("layer_pattern", "layer_kinds", "sliding_window", "rope_theta", "rope_scaling")


def _layers(cfg: ModelConfig) -> list:
    """Each layer as it computes: its attention's window, its RoPE where it rotates, its
    mixer, its parallel mixer, whether it has a feed-forward network, its multipliers."""
    out = []
    for i in cfg.layer_kind_ids:
        k = cfg.kinds[i]
        rotary = POSITION_SCHEMES[cfg.position].kind == "rotary"
        rope = (k.rope_theta, k.rope_scaling) if rotary and k.rope else None
        out.append((k.window, rope, k.mixer, k.parallel, k.ffn, k.mixer_in_multiplier,
                    k.mixer_out_multiplier, k.ffn_gate_multiplier, k.ffn_out_multiplier,
                    k.chunk, k.qk_norm or cfg.qk_norm == "none",
                    (k.temperature_floor, k.temperature_scale) if k.temperature_floor else None))
    return out


def _moe(cfg: ModelConfig) -> dict | None:
    """model.moe as it computes: widths as the layers use them, routers that choose and
    weigh alike as one, and the training-time settings transformers has no key for aside
    (z_loss; dispatch and capacity_factor: the written model is the dropless one)."""
    m = cfg.moe
    if not m.experts:
        return None
    row = ROUTERS[m.router]
    return dict(
        experts=m.experts, top_k=m.top_k, d_ff=cfg.expert_d_ff, layers=cfg.sparse_layers,
        shared_d_ff=cfg.shared_d_ff if m.shared_experts else 0, shared_gate=m.shared_gate,
        scores=row.scores, normalise=m.norm_topk if row.normalise is None else row.normalise,
        norm_min=row.norm_min,
        score_bias=m.has_score_bias, bias=m.bias, scales_input=row.scales_input,
        routed_scale=float(f"{m.routed_scale:.9g}"),
        groups=(m.groups, m.topk_groups, row.group_score) if m.groups > 1 else None,
        aux_loss=float(f"{m.aux_loss:.9g}"))


def _computed(cfg: ModelConfig, name: str):
    """A field as the model computes with it: model.moe by _moe, and d_ff, which no layer
    reads when every layer is sparse, as None then."""
    if name == "moe":
        return _moe(cfg)
    if name == "mixer":  # the settings of the mixers the layers use, given or default
        return {m: _computing(cfg.mixer_settings(m)) for m in sorted(_mixers(cfg))}
    if name == "encoder_layers" and ARCHS[cfg.arch].cross_attention:  # None: n_layers
        return cfg.encoder_n_layers
    if name == "d_ff" and all(cfg.sparse_layers):
        return None
    return getattr(cfg, name)


def _mixers(cfg: ModelConfig) -> set[str]:
    """The mixers a model's layers run, parallel ones included."""
    return set(cfg.layer_mixers) | {m for m in cfg.layer_parallels if m}


def _computing(settings):
    """A mixer's settings that change what it computes (its RUNTIME ones aside: chunk)."""
    if settings is None:
        return None
    return {k: v for k, v in dataclasses.asdict(settings).items()
            if k not in getattr(settings, "RUNTIME", ())}


def differences(cfg: ModelConfig, other: ModelConfig) -> list[str]:
    """The fields in which `other` computes differently from cfg (the runtime fields and
    the spelling of a layer pattern or of model.moe aside; numbers equal to 1e-9
    relative)."""
    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-9)
        return a == b
    diffs = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME +
             _PER_LAYER and not same(_computed(cfg, f.name), _computed(other, f.name))]
    if "position" in diffs and "position_settings" in diffs:
        diffs.remove("position_settings")  # another scheme's settings: its position says it
    if _layers(cfg) != _layers(other):
        diffs.append("layer_kinds" if cfg.layer_pattern else "sliding_window"
                     if {w[0] for w in _layers(cfg)} != {w[0] for w in _layers(other)}
                     else "rope_theta / rope_scaling")
    return diffs


def _may_express(row, cfg: ModelConfig) -> bool:
    """Whether model type `row` is tried for cfg: its arch; its mixers (a hybrid by the
    families whose layers hold its mixers, a model of attention alone by the families of
    attention alone); experts where cfg has them (and no experts where it has none, unless
    the family ships dense models too)."""
    dense = row.moe is None or row.moe.dense_too
    experts = bool(cfg.moe.experts)
    plain = set(HFModelType.__dataclass_fields__["mixers"].default)  # attention alone
    hybrid = bool(_mixers(cfg) - plain)
    return (row.arch == cfg.arch and _mixers(cfg) <= set(row.mixers)
            and hybrid == (set(row.mixers) != plain)
            and (row.moe is not None if experts else dense))


def export_model_type(cfg: ModelConfig) -> str:
    """The first model type (by export rank) whose config.json, read back, is cfg's model.
    Writers write what they can (a value a type has no spelling for at all, e.g. NTK
    scaling, raises); the round trip finds the rest. A model no type writes is a
    ConfigError naming the fields of the nearest type that differ (a mixture of experts
    is written, and compared, by the types with experts alone; a dense model by the rest;
    each model by the types of its model.arch, and whose layers hold its mixers)."""
    nearest = None
    for row in sorted(MODEL_TYPES.values(), key=lambda row: row.export_rank):
        if not _may_express(row, cfg):
            continue
        try:
            back = config_from_hf(_write(cfg, row, "float32"))
        except ConfigError as e:  # the writer (or reader) names the one value it cannot say
            miss = (1, str(e))
        else:
            diffs = differences(cfg, back)
            if not diffs:
                return row.name
            miss = (len(diffs), f"model.{diffs[0]}={getattr(cfg, diffs[0].split()[0])!r} "
                    f"cannot be written as a Hugging Face checkpoint: no supported model type "
                    f"expresses it (the nearest, {row.name}, differs in {', '.join(diffs)})")
        if nearest is None or miss[0] < nearest[0]:
            nearest = miss
    if nearest is None:
        raise ConfigError(f"model.arch={cfg.arch!r} cannot be written as a Hugging Face "
                          "checkpoint: no supported model type holds that arch")
    raise ConfigError(nearest[1])


def config_to_hf(cfg: ModelConfig, dtype: str = "float32",
                 model_type: str | None = None) -> dict[str, Any]:
    """A config.json (as a dict) that transformers reads as the same model. model_type:
    written as that model type (a model that computes as several, e.g. ERNIE 4.5 as
    Llama), a ConfigError where it does not read back as cfg's model; None: the first by
    export rank (export_model_type)."""
    if model_type is None:
        return _write(cfg, MODEL_TYPES[export_model_type(cfg)], dtype)
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not a supported model type: "
                          f"{', '.join(MODEL_TYPES)}")
    row = MODEL_TYPES[model_type]
    held = f"arch, mixers or experts (it holds {row.arch} models of {', '.join(row.mixers)})"
    diffs = differences(cfg, config_from_hf(_write(cfg, row, "float32"))) \
        if _may_express(row, cfg) else [held]
    if diffs:
        raise ConfigError(f"model_type={model_type!r} cannot write this model: its "
                          f"config.json would differ in {', '.join(diffs)}")
    return _write(cfg, row, dtype)


def _write(cfg: ModelConfig, row: HFModelType, dtype: str) -> dict[str, Any]:
    common = dict(architectures=[row.architectures[0]], model_type=row.name,
                  vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, dtype=dtype,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True)
    return dict(common, **row.write_config(cfg, row))
