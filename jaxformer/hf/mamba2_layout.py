"""Mamba-2's families (jaxformer.model.mixers.mamba2): mamba2 and bamba, and the mixer's
tensors the other Mamba-2 hybrids share: their config.json readers and writers and tensor
rules, and their rows.

The mixer's keys differ by family (Mamba2Config's num_heads, Bamba's mamba_n_heads,
Nemotron-H's mamba_num_heads): a family passes its key names (MAMBA2_KEYS, BAMBA_KEYS, or
its own) to read_mamba2_settings / write_mamba2_settings. Its tensors (in_proj as z | x |
B | C | dt, conv1d, dt_bias, A_log, D, norm, out_proj) are the same everywhere but for the
module's name (mixer, mamba): mixer_rules.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear, reshaped, split_rows
from jaxformer.model.mixers.mamba2 import Mamba2Settings

# Mamba2Settings field (and: expand, act) -> its config.json key, per family. "dt_limit"
# names a [low, high] pair (time_step_limit); a family whose clamp is (low, inf) from a
# key of its own names it as "dt_limit_low". A field a family has no key for keeps its
# default (read) and must be that default (written). "expand": the inner width is
# expand * hidden_size (checked; "auto" head_dim is read from it); "act": the
# convolution's activation key (silu).
MAMBA2_KEYS = dict(heads="num_heads", head_dim="head_dim", groups="n_groups",
                   state="state_size", conv="conv_kernel", chunk="chunk_size",
                   conv_bias="use_conv_bias", bias="use_bias", dt_min="time_step_min",
                   dt_max="time_step_max", dt_floor="time_step_floor",
                   dt_limit="time_step_limit", expand="expand", act="hidden_act")
BAMBA_KEYS = dict(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups",
                  state="mamba_d_state", conv="mamba_d_conv", chunk="mamba_chunk_size",
                  conv_bias="mamba_conv_bias", bias="mamba_proj_bias",
                  dt_limit="time_step_limit", expand="mamba_expand", act="hidden_act")
_PLAIN = ("heads", "head_dim", "groups", "state", "conv", "chunk", "conv_bias", "bias",
          "dt_min", "dt_max", "dt_floor")


def read_mamba2_settings(get: Callable, keys: Mapping[str, str],
                         family: str = "this family") -> dict[str, Any]:
    """model.mixer.mamba2 (a mapping of Mamba2Settings' fields) from a config.json: `get`
    reads a key or its default (jaxformer.hf.config_json.key_reader), `keys` maps each
    field to the family's key (MAMBA2_KEYS, BAMBA_KEYS; fields without a key keep
    Mamba2Settings' defaults). A value jaxformer cannot compute is a ConfigError naming
    the key and `family`."""
    if "act" in keys and get(keys["act"]) != "silu":
        raise unsupported(keys["act"], get(keys["act"]), f"{family}'s Mamba-2 convolution "
                          "activation in jaxformer is silu")
    out = {f: get(keys[f]) for f in _PLAIN if f in keys}
    for f in ("conv_bias", "bias"):
        if f in out:
            out[f] = bool(out[f])
    for f in ("dt_min", "dt_max", "dt_floor"):
        if f in out:
            out[f] = float(out[f])
    if "expand" in keys:
        inner = get(keys["expand"]) * get("hidden_size")
        if out.get("head_dim") == "auto":
            out["head_dim"] = inner // out["heads"]
        if out["heads"] * out["head_dim"] != inner:
            raise unsupported(keys["expand"], get(keys["expand"]), f"{family}'s Mamba-2 width "
                              f"expand * hidden_size must be heads * head_dim "
                              f"({out['heads']} * {out['head_dim']})")
    out.update(_read_limit(get, keys, family))
    return out


def _read_limit(get, keys, family) -> dict[str, Any]:
    """dt_limit_low / dt_limit_high from a [low, high] key or a low-only key."""
    if "dt_limit_low" in keys:
        return {"dt_limit_low": float(get(keys["dt_limit_low"]))}
    if "dt_limit" not in keys:
        return {}
    limit = get(keys["dt_limit"])
    if limit is None:  # transformers' default when the key is null: no clamp
        return {"dt_limit_low": 0.0, "dt_limit_high": None}
    if len(limit) != 2 or float(limit[0]) > float(limit[1]):
        raise unsupported(keys["dt_limit"], limit, f"{family}'s time step limit is a pair "
                          "[low, high] with low <= high")
    high = float(limit[1])
    return {"dt_limit_low": float(limit[0]), "dt_limit_high": None if math.isinf(high)
            else high}


def write_mamba2_settings(s: Mamba2Settings, keys: Mapping[str, str], d_model: int,
                          family: str = "this family") -> dict[str, Any]:
    """The config.json keys of model.mixer.mamba2 `s` under the family's `keys` (those of
    read_mamba2_settings); a setting the family has no key for and that is not the
    default is a ConfigError naming it."""
    default = Mamba2Settings()
    out = {}
    for f in _PLAIN:
        if f in keys:
            out[keys[f]] = getattr(s, f)
        elif getattr(s, f) != getattr(default, f):
            raise cannot(f"mixer.mamba2.{f}", getattr(s, f), f"{family} has no key for it")
    if "expand" in keys:
        if s.inner % d_model:
            raise cannot("mixer.mamba2.heads", s.heads, f"{family}'s Mamba-2 width is expand * "
                         f"hidden_size, an integer multiple of {d_model}: heads * head_dim = "
                         f"{s.inner}")
        out[keys["expand"]] = s.inner // d_model
    if "act" in keys:
        out[keys["act"]] = "silu"
    high = math.inf if s.dt_limit_high is None else s.dt_limit_high
    if "dt_limit" in keys:
        out[keys["dt_limit"]] = [s.dt_limit_low, high]
    elif "dt_limit_low" in keys and s.dt_limit_high is None:
        out[keys["dt_limit_low"]] = s.dt_limit_low
    elif (s.dt_limit_low, s.dt_limit_high) != (default.dt_limit_low, default.dt_limit_high):
        raise cannot("mixer.mamba2.dt_limit_high", s.dt_limit_high, f"{family}'s time "
                     "step is clamped below alone")
    return out


# ---- tensors ----------------------------------------------------------------------


def _in_shapes(d: int, s: Mamba2Settings):
    """(our projection, its rows of in_proj, its kernel's shape), in in_proj's order."""
    h, p, g, n = s.heads, s.head_dim, s.groups, s.state
    return (("in_z", h * p, (d, h, p)), ("in_x", h * p, (d, h, p)), ("in_b", g * n, (d, g, n)),
            ("in_c", g * n, (d, g, n)), ("in_dt", h, (d, h)))


def _in_bias(m: Path, name: str, d: int, s: Mamba2Settings) -> Rule:
    """in_proj's bias [z | x | B | C | dt] <-> each projection's bias."""
    parts = _in_shapes(d, s)
    cuts = list(np.cumsum([rows for _, rows, _ in parts])[:-1])
    return Rule(tuple(m + (ours, "bias") for ours, _, _ in parts), (name,),
                ((sum(rows for _, rows, _ in parts),),),
                lambda b: tuple(x.reshape(shape[1:]) for x, (_, _, shape) in
                                zip(np.split(b, cuts), parts)),
                lambda *bs: (np.concatenate([b.reshape(-1) for b in bs]),))


def mixer_rules(cfg, block_path: Path, hf_prefix: str, s: Mamba2Settings) -> list[Rule]:
    """The tensors of one Mamba-2 mixer: HF's module at `hf_prefix` (e.g.
    "backbone.layers.3.mixer." or "model.layers.3.mamba.") <-> our Mamba2Mixer's params at
    block_path + ("mixer",) (block_path: the layer's Block, e.g. ("block_3",)).

    in_proj [z | x | B | C | dt, D] -> in_z, in_x [D, heads, head_dim], in_b, in_c
    [D, groups, state], in_dt [D, heads] (and their biases where s.bias); conv1d.weight
    [C, 1, K] -> conv [K, C] (C: x | B | C channels), conv1d.bias -> conv_bias; dt_bias,
    A_log, D [heads]; norm.weight [heads * head_dim] -> norm [heads, head_dim]; out_proj
    [D, heads * head_dim] -> out [heads, head_dim, D] (+ bias [D])."""
    d, h, p, k, c = cfg.d_model, s.heads, s.head_dim, s.conv, s.conv_channels
    m, t = tuple(block_path) + ("mixer",), hf_prefix
    parts = _in_shapes(d, s)
    rules = [split_rows(m, [ours for ours, _, _ in parts], f"{t}in_proj.weight",
                        [rows for _, rows, _ in parts], d, [shape for _, _, shape in parts]),
             Rule((m + ("conv",),), (f"{t}conv1d.weight",), ((c, 1, k),),
                  lambda w: (w[:, 0, :].T,), lambda w: (w.T[:, None, :],)),
             *(copied(m + (x,), f"{t}{x}", (h,)) for x in ("dt_bias", "A_log", "D")),
             reshaped(m + ("norm",), f"{t}norm.weight", (h * p,), (h, p)),
             linear(m + ("out", "kernel"), f"{t}out_proj.weight", (d, h * p), (h, p, d))]
    if s.conv_bias:
        rules.append(copied(m + ("conv_bias",), f"{t}conv1d.bias", (c,)))
    if s.bias:
        rules += [_in_bias(m, f"{t}in_proj.bias", d, s),
                  copied(m + ("out", "bias"), f"{t}out_proj.bias", (d,))]
    return rules


ROWS: list = []  # HFModelType rows (jaxformer.hf.model_type)
