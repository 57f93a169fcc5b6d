"""HF's per-layer attention (layer_types, sliding_window, NoPE layers, RoPE per layer type)
<-> jaxformer's model.layer_pattern and model.layer_kinds.

A layer of type full_attention or sliding_attention, rotated or not (NoPE), is a kind
named after it ("full", "sliding", "full_nope", ...); the pattern is the shortest period
of the layers' kinds. A model whose layers are all alike gets no pattern: a window for
every layer is model.sliding_window, and NoPE everywhere is position "none". What differs
between model types (how they choose the types, gate the window, skip RoPE) is read from
their row (jaxformer.hf.families).
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.model.config import ModelConfig, RopeScaling

TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _types(hf, get, row) -> list[str]:
    n = get("num_hidden_layers")
    if row.layer_type is None:
        return ["full_attention"] * n
    types = hf.get("layer_types") if row.layer_types_key else None
    if types is None:
        return [row.layer_type(get, i) for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise unsupported("layer_types", types, f"it must list one type per layer ({n})")
    bad = sorted(set(types) - set(TYPES))
    if bad:
        raise unsupported("layer_types", bad, f"{row.name} layers in jaxformer are "
                          f"{' or '.join(TYPES)}")
    return types


def _window(get, row, types: list[str]) -> int | None:
    if "sliding_attention" not in types:
        return None
    window = get("sliding_window")
    if row.use_sliding_window and not get("use_sliding_window"):
        window = None  # as the family's config class: no window unless use_sliding_window
    if window is None:
        raise unsupported("layer_types", types, "it lists sliding_attention layers, but "
                          "there is no sliding_window (or use_sliding_window is false)")
    return window


def _period(names: list[str]) -> list[str]:
    """The shortest prefix that, repeated, gives `names`."""
    for p in range(1, len(names) + 1):
        if all(names[i] == names[i % p] for i in range(len(names))):
            return names[:p]
    return names


def layer_fields(hf, get, row, ropes) -> dict[str, Any]:
    """ModelConfig fields for the layers' attention: layer_pattern and layer_kinds, or
    sliding_window (and rope_theta, rope_scaling, position). row: the model type's
    (jaxformer.hf.families); ropes: layer type -> (theta, RopeScaling)."""
    types = _types(hf, get, row)
    window = _window(get, row, types)
    kinds, names = {}, []
    for i, kind_type in enumerate(types):
        rotated = row.rope_of is None or row.rope_of(get, i, kind_type)
        name = TYPES[kind_type] + ("" if rotated else "_nope")
        theta, scaling = ropes[kind_type]
        kinds[name] = dict(window=window if kind_type == "sliding_attention" else None,
                           rope=rotated, rope_theta=float(theta) if rotated else None,
                           rope_scaling=scaling if rotated else None)
        names.append(name)
    rotated = [k for k in kinds.values() if k["rope"]]
    first = rotated[0] if rotated else {"rope_theta": 10000.0, "rope_scaling": RopeScaling()}
    base = dict(rope_theta=first["rope_theta"], rope_scaling=first["rope_scaling"])
    if len(kinds) == 1:  # every layer alike: no pattern
        (kind,) = kinds.values()
        return dict(base, sliding_window=kind["window"],
                    position="rope" if kind["rope"] else "none")
    for kind in kinds.values():  # a kind's RoPE as the model's is left unset
        if kind["rope_theta"] == base["rope_theta"] and kind["rope_scaling"] == base["rope_scaling"]:
            kind.update(rope_theta=None, rope_scaling=None)
    return dict(base, layer_pattern=tuple(_period(names)), layer_kinds=kinds)


def layers_to_hf(cfg: ModelConfig, row) -> dict[str, Any]:
    """layer_types, sliding_window (and use_sliding_window) as the model type writes them."""
    layers = [cfg.kinds[i] for i in cfg.layer_kind_ids]
    windows = {k.window for k in layers if k.window is not None}
    if len(windows) > 1:
        raise cannot("layer_kinds", sorted(windows), "HF has one sliding_window for every "
                     "sliding layer")
    window = windows.pop() if windows else None
    types = ["full_attention" if k.window is None else "sliding_attention" for k in layers]
    out: dict[str, Any] = {}
    if row.layer_type is not None:
        out["sliding_window"] = window
    if row.layer_types_key:
        out["layer_types"] = types
    if row.use_sliding_window:
        out.update(use_sliding_window=window is not None, max_window_layers=0)
    return out


def rope_per_type_from_hf(hf, get, max_len: int, defaults: dict, legacy: dict) -> dict:
    """layer type -> (theta, RopeScaling) for families whose rope_parameters are keyed by
    layer type (Gemma 3, OLMo 3), read as their transformers 5 config classes read it: each
    type's entry of rope_parameters (missing or null: plain RoPE), a legacy rope_scaling
    merged into the full-attention entry (its keys win), and a theta that an entry still
    lacks from the type's top-level legacy key, else the type's default. Keys of
    rope_parameters beside the types' entries (a flat rope_type, factor, rope_theta) are
    not read: transformers builds these families' rotary embeddings from the entries alone."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise unsupported("rope_parameters", params, "it must be a mapping")
    params = params or {}
    bad = sorted(k for k, v in params.items() if isinstance(v, Mapping) and k not in TYPES)
    if bad:
        raise unsupported("rope_parameters", bad, f"layer types are {', '.join(TYPES)}")
    entries = {t: dict(params.get(t) or {"rope_type": "default"}) for t in TYPES}
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if hf.get("rope_parameters") is not None and params.get("full_attention") is None:
            raise unsupported("rope_scaling", scaling, "beside a rope_parameters without a "
                              "full_attention entry (transformers cannot load it either)")
        entries["full_attention"].update(scaling)
    thetas = dict(defaults)
    for key, kind_type in legacy.items():
        if key in hf:
            thetas[kind_type] = hf[key]
    out = {}
    for kind_type, entry in entries.items():
        entry.setdefault("rope_theta", thetas[kind_type])
        if rotary_fraction({"rope_parameters": entry}, lambda k, d: d) != 1:
            raise unsupported(f"rope_parameters.{kind_type}.partial_rotary_factor",
                              entry["partial_rotary_factor"], "RoPE per layer type rotates "
                              "every dimension of a head")
        out[kind_type] = rope_from_hf({"rope_parameters": entry}, get, max_len)
    return out


def rope_per_type_to_hf(cfg: ModelConfig) -> dict:
    layers = [cfg.kinds[i] for i in cfg.layer_kind_ids]
    out = {}
    for kind_type in TYPES:
        ropes = {(k.rope_theta, k.rope_scaling) for k in layers if k.rope and
                 (k.window is None) == (kind_type == "full_attention")}
        if len(ropes) > 1:
            raise cannot("layer_kinds", f"several RoPE bases among {kind_type} layers",
                         "HF has one RoPE per layer type")
        theta, scaling = ropes.pop() if ropes else (cfg.rope_theta, cfg.rope_scaling)
        out[kind_type] = rope_dict(theta, scaling)
    return out
