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

from jaxformer.hf.llama_layout import _attention, _mlp, head_dim
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear, reshaped, rope_permutation, \
    split_rows
from jaxformer.model.config import ModelConfig
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
# fields only some families have keys for (Falcon-H1's): read as bools or numbers
_FLAGS = ("norm", "norm_before_gate", "out_bias")
_SCALES = ("in_multiplier", "out_multiplier")
# (a family's "d_ssm" key: the inner width itself, in place of expand * hidden_size where
# it is not null; "part_multipliers": the five multipliers of z, x, B, C and dt)


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
    out = {f: get(keys[f]) for f in _PLAIN + _FLAGS + _SCALES if f in keys}
    for f in ("conv_bias", "bias") + _FLAGS:
        if f in out:
            out[f] = bool(out[f])
    for f in ("dt_min", "dt_max", "dt_floor") + _SCALES:
        if f in out:
            out[f] = float(out[f])
    if "part_multipliers" in keys:
        parts = get(keys["part_multipliers"]) or (1.0,) * 5  # null: transformers' ones
        out["part_multipliers"] = tuple(float(m) for m in parts)
    d_ssm = get(keys["d_ssm"]) if "d_ssm" in keys else None
    if "expand" in keys or d_ssm is not None:
        inner = d_ssm if d_ssm is not None else get(keys["expand"]) * get("hidden_size")
        if out.get("head_dim") == "auto":
            out["head_dim"] = inner // out["heads"]
        if out["heads"] * out["head_dim"] != inner:
            key = keys["d_ssm"] if d_ssm is not None else keys["expand"]
            raise unsupported(key, get(key), f"{family}'s Mamba-2 width ({key}) must be "
                              f"heads * head_dim ({out['heads']} * {out['head_dim']})")
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
    for f in _PLAIN + _FLAGS + _SCALES + ("part_multipliers",):
        value = s.out_biased if f == "out_bias" else getattr(s, f)
        if f in keys:
            out[keys[f]] = list(value) if f == "part_multipliers" else value
        elif value != (s.bias if f == "out_bias" else getattr(default, f)):
            raise cannot(f"mixer.mamba2.{f}", value, f"{family} has no key for it")
    if "d_ssm" in keys:
        out[keys["d_ssm"]] = s.inner
    elif "expand" in keys:
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


def mixer_rules(cfg, block_path: Path, hf_prefix: str, s: Mamba2Settings,
                module: str = "mixer") -> list[Rule]:
    """The tensors of one Mamba-2 mixer: HF's module at `hf_prefix` (e.g.
    "backbone.layers.3.mixer." or "model.layers.3.mamba.") <-> our Mamba2Mixer's params at
    block_path + (module,) (block_path: the layer's Block, e.g. ("block_3",); module:
    mixer, or parallel_mixer beside attention). No norm where s.norm is false; out_proj's
    bias where s.out_biased.

    in_proj [z | x | B | C | dt, D] -> in_z, in_x [D, heads, head_dim], in_b, in_c
    [D, groups, state], in_dt [D, heads] (and their biases where s.bias); conv1d.weight
    [C, 1, K] -> conv [K, C] (C: x | B | C channels), conv1d.bias -> conv_bias; dt_bias,
    A_log, D [heads]; norm.weight [heads * head_dim] -> norm [heads, head_dim]; out_proj
    [D, heads * head_dim] -> out [heads, head_dim, D] (+ bias [D])."""
    d, h, p, k, c = cfg.d_model, s.heads, s.head_dim, s.conv, s.conv_channels
    m, t = tuple(block_path) + (module,), hf_prefix
    parts = _in_shapes(d, s)
    rules = [split_rows(m, [ours for ours, _, _ in parts], f"{t}in_proj.weight",
                        [rows for _, rows, _ in parts], d, [shape for _, _, shape in parts]),
             Rule((m + ("conv",),), (f"{t}conv1d.weight",), ((c, 1, k),),
                  lambda w: (w[:, 0, :].T,), lambda w: (w.T[:, None, :],)),
             *(copied(m + (x,), f"{t}{x}", (h,)) for x in ("dt_bias", "A_log", "D")),
             linear(m + ("out", "kernel"), f"{t}out_proj.weight", (d, h * p), (h, p, d))]
    if s.norm:
        rules.append(reshaped(m + ("norm",), f"{t}norm.weight", (h * p,), (h, p)))
    if s.conv_bias:
        rules.append(copied(m + ("conv_bias",), f"{t}conv1d.bias", (c,)))
    if s.bias:
        rules.append(_in_bias(m, f"{t}in_proj.bias", d, s))
    if s.out_biased:
        rules.append(copied(m + ("out", "bias"), f"{t}out_proj.bias", (d,)))
    return rules



# ---- the families ------------------------------------------------------------------

MAMBA2 = "mamba2"  # the mixer's name (jaxformer.model.mixers.MIXERS)
# mamba2's fields of the attention and the MLP, which no layer reads (written nowhere,
# read back as these)
NO_ATTENTION = dict(n_heads=1, position="none", ffn="swiglu", use_bias=False)


def _period(names: list[str]) -> list[str]:
    """The shortest prefix that, repeated, gives `names`."""
    return next(names[:p] for p in range(1, len(names) + 1)
                if all(names[i] == names[i % p] for i in range(len(names))))


def _check_layers(cfg: ModelConfig, row, allowed: Mapping[tuple[str, bool], str]) -> list:
    """Each layer's HF type, its (mixer, ffn) one of `allowed`'s, else a ConfigError."""
    out = []
    for i in cfg.layer_kind_ids:
        kind = cfg.kinds[i]
        if (kind.mixer, kind.ffn) not in allowed:
            raise cannot("layer_kinds", f"mixer={kind.mixer}, ffn={kind.ffn}",
                         f"{row.name}'s layers are {' or '.join(allowed.values())}")
        out.append(allowed[kind.mixer, kind.ffn])
    return out


def read_mamba2(hf, get, row) -> ModelConfig:
    """Mamba2ForCausalLM: every layer a Mamba-2 mixer alone (no FFN, no attention, no
    positions), RMSNorms of layer_norm_epsilon. residual_in_fp32 is read as either value:
    jaxformer's residual is the model's dtype (the same in float32)."""
    mixer = read_mamba2_settings(get, MAMBA2_KEYS, row.name)
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), norm="rmsnorm", norm_eps=float(get(row.eps_key)),
        tie_embeddings=bool(get("tie_word_embeddings")), layer_pattern=["mamba"],
        layer_kinds={"mamba": {"mixer": MAMBA2, "ffn": False}}, mixer={MAMBA2: mixer},
        **NO_ATTENTION)


def write_mamba2(cfg: ModelConfig, row) -> dict[str, Any]:
    """Mamba2Config keys; a model with other layers (or other attention fields, which the
    round trip finds) is refused."""
    _check_layers(cfg, row, {(MAMBA2, False): "a Mamba-2 mixer alone"})
    return dict(write_mamba2_settings(cfg.mixer_settings(MAMBA2), MAMBA2_KEYS, cfg.d_model,
                                      row.name),
                hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                layer_norm_epsilon=cfg.norm_eps, residual_in_fp32=True,
                initializer_range=0.02)


def _bamba_fraction(hf) -> float:
    """Bamba's rotated share: rope_parameters' partial_rotary_factor, else 0.5 (BambaConfig
    sets it whatever the top-level key says)."""
    return rotary_fraction({k: v for k, v in hf.items() if k != "partial_rotary_factor"},
                           lambda key, default=None: 0.5)


def read_bamba(hf, get, row) -> ModelConfig:
    """BambaForCausalLM: Mamba-2 layers and attention layers (attn_layer_indices), each
    with a SwiGLU MLP; Llama attention with partial RoPE (half of each head by default)."""
    for key, allowed, why in row.refuse:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({row.name})")
    if bool(get("attention_bias")) != bool(get("mlp_bias")):
        raise unsupported("attention_bias", get("attention_bias"), f"{row.name} in jaxformer "
                          f"has biases on attention and MLP alike (mlp_bias={get('mlp_bias')})")
    n, n_heads, max_len = get("num_hidden_layers"), get("num_attention_heads"), \
        get("max_position_embeddings")
    attn = get("attn_layer_indices") or []
    names = ["attn" if i in attn else "mamba" for i in range(n)]
    theta, scaling = rope_from_hf(hf, get, max_len)
    kinds = {"mamba": {"mixer": MAMBA2}, "attn": {}}
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=n,
        n_heads=n_heads, n_kv_heads=get("num_key_value_heads") or n_heads,
        head_dim=head_dim(get), d_ff=get("intermediate_size"), max_seq_len=max_len,
        position="rope", rope_theta=float(theta), rope_scaling=scaling,
        rope_fraction=_bamba_fraction(hf), norm="rmsnorm", norm_eps=float(get(row.eps_key)),
        ffn="swiglu", use_bias=bool(get("attention_bias")),
        tie_embeddings=bool(get("tie_word_embeddings")), layer_pattern=_period(names),
        layer_kinds={k: v for k, v in kinds.items() if k in names},
        mixer={MAMBA2: read_mamba2_settings(get, BAMBA_KEYS, row.name)} if "mamba" in names
        else None)


def write_bamba(cfg: ModelConfig, row) -> dict[str, Any]:
    """BambaConfig keys; what Bamba cannot say (windows, a RoPE per layer, QK-norm) is
    caught by the round trip of jaxformer.convert.hf_config."""
    types = _check_layers(cfg, row, {(MAMBA2, True): "a Mamba-2 mixer with an MLP",
                                     ("attention", True): "attention with an MLP"})
    rope = dict(rope_dict(cfg.rope_theta, cfg.rope_scaling),
                partial_rotary_factor=cfg.rope_fraction)
    return dict(write_mamba2_settings(cfg.mixer_settings(MAMBA2), BAMBA_KEYS, cfg.d_model,
                                      row.name),
                hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias,
                attn_layer_indices=[i for i, t in enumerate(types) if t.startswith("attention")],
                rope_parameters=rope, initializer_range=0.02)


def mamba2_tensors(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """Mamba2ForCausalLM's tensors, under backbone.: embeddings; layers.N.norm (attn_norm)
    and layers.N.mixer (mixer_rules); norm_f (final_norm); lm_head unless tied."""
    d, v, t = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embeddings.weight", (v, d))]
    for i in range(cfg.n_layers):
        rules += mixer_rules(cfg, (f"block_{i}",), f"{t}layers.{i}.mixer.",
                             cfg.mixer_settings(MAMBA2))
        rules.append(copied((f"block_{i}", "attn_norm", "scale"), f"{t}layers.{i}.norm.weight",
                            (d,)))
    rules.append(copied(("final_norm", "scale"), f"{t}norm_f.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def _bamba_attention(cfg: ModelConfig, b: Path, p: str, rope) -> list[Rule]:
    """An attention layer's self_attn: Llama's q, k, v (and biases), o_proj (and bias)."""
    d, n, h = cfg.d_model, cfg.n_heads, cfg.head_dim
    rules = _attention(cfg, b + ("attn",), f"{p}self_attn.", rope, False)
    rules.append(linear(b + ("attn", "out", "kernel"), f"{p}self_attn.o_proj.weight",
                        (d, n * h), (n, h, d)))
    if cfg.use_bias:
        rules.append(copied(b + ("attn", "out", "bias"), f"{p}self_attn.o_proj.bias", (d,)))
    return rules


# a Bamba layer's mixer -> its rules (block path, the layer's HF prefix, the q/k RoPE layout)
BAMBA_MIXERS = {
    MAMBA2: lambda cfg, b, p, rope: mixer_rules(cfg, b, f"{p}mamba.", cfg.mixer_settings(MAMBA2)),
    "attention": _bamba_attention}


def bamba_tensors(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """BambaForCausalLM's tensors, under model.: embed_tokens; layers.N.input_layernorm
    (attn_norm) and pre_ff_layernorm (ffn_norm); a Mamba-2 layer's mamba (mixer_rules), an
    attention layer's self_attn (Llama's); feed_forward.{gate,up,down}_proj (Llama's MLP);
    final_layernorm (final_norm); lm_head unless tied."""
    d, v, t = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rope = rope_permutation(rope_layout)
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i, mixer in enumerate(cfg.layer_mixers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += BAMBA_MIXERS[mixer](cfg, (b,), p, rope)
        rules += mlp_and_norms(cfg, b, p)
    rules.append(copied(("final_norm", "scale"), f"{t}final_layernorm.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def mlp_and_norms(cfg: ModelConfig, b: str, p: str) -> list[Rule]:
    """A Bamba-layout layer's MLP (feed_forward.{gate,up,down}_proj, biases where the model
    has them) and its two norms (input_layernorm, pre_ff_layernorm): Bamba's, Falcon-H1's."""
    d = cfg.d_model
    rules = _mlp(cfg, (b, "ffn"), f"{p}feed_forward.", False)
    if cfg.use_bias:
        rules += [copied((b, "ffn", ours, "bias"), f"{p}feed_forward.{hf}.bias", (width,))
                  for ours, hf, width in (("wi_gate", "gate_proj", cfg.d_ff),
                                          ("wi_up", "up_proj", cfg.d_ff), ("wo", "down_proj", d))]
    return rules + [copied((b, ours, "scale"), f"{p}{hf}.weight", (d,)) for ours, hf in
                    (("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"))]


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        "mamba2", ("Mamba2ForCausalLM", "Mamba2Model"), export_rank=35, mixers=("mamba2",),
        defaults=dict(head_dim=64, state_size=128, layer_norm_epsilon=1e-5, expand=2,
                      conv_kernel=4, n_groups=8, use_bias=False, use_conv_bias=True,
                      hidden_act="silu", time_step_min=0.001, time_step_max=0.1,
                      time_step_floor=1e-4, time_step_limit=(0.0, math.inf),
                      chunk_size=256, tie_word_embeddings=False, residual_in_fp32=True),
        read_config=read_mamba2, write_config=write_mamba2, tensor_rules=mamba2_tensors,
        tensor_prefix="backbone.", eps_key="layer_norm_epsilon"),
    HFModelType(
        "bamba", ("BambaForCausalLM", "BambaModel"), export_rank=36, mixers=("attention", "mamba2"),
        defaults=dict(num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
                      max_position_embeddings=262144, attn_layer_indices=None,
                      mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
                      mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                      mamba_conv_bias=True, mamba_proj_bias=False,
                      time_step_limit=(0.0, math.inf), attention_bias=False, mlp_bias=False,
                      tie_word_embeddings=False, head_dim=None, rope_theta=10000.0),
        read_config=read_bamba, write_config=write_bamba, tensor_rules=bamba_tensors,
        refuse=(("hidden_act", ("silu",), "its MLP (SwiGLU) and Mamba-2 convolution in "
                 "jaxformer use silu"),)),
]
