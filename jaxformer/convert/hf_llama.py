"""config.json <-> ModelConfig for the Llama lineage: every family whose checkpoint is
Llama's layout (model.layers.N.self_attn.q_proj, mlp.gate_proj, ...) with its own twists,
written as one row per model type (LINEAGE) that a single reader and writer follow.

Layer types (HF's layer_types: full_attention / sliding_attention per layer, and NoPE
layers) become a model.layer_pattern of kinds named after them (jaxformer.convert.hf_layers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jaxformer.config import ConfigError, ModelConfig
from jaxformer.convert.hf_layers import (layer_fields, layers_to_hf, rope_per_type_from_hf,
                                         rope_per_type_to_hf)
from jaxformer.convert.hf_rope import cannot, rope_dict, rope_from_hf, unsupported

ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}


def _every(n: int):
    """Default layer types: sliding, except every n-th layer (i + 1 divisible by n)."""
    return lambda get, i: "full_attention" if (i + 1) % n == 0 else "sliding_attention"


def _from_key(key: str, default: int):
    return lambda get, i: ("full_attention" if (i + 1) % (get(key) or default) == 0
                           else "sliding_attention")


def _qwen_types(get, i):  # transformers' rule: layers from max_window_layers on slide
    slide = get("use_sliding_window") and get("sliding_window") is not None
    return "sliding_attention" if slide and i >= get("max_window_layers") else "full_attention"


def _smollm3_types(get, i):  # sliding only where use_sliding_window, and a NoPE layer
    slide = get("use_sliding_window") and get("sliding_window") is not None
    return "sliding_attention" if slide and not _smollm3_rope(get, i) else "full_attention"


def _smollm3_rope(get, i) -> bool:
    layers = get("no_rope_layers")
    if layers is None:
        return bool((i + 1) % get("no_rope_layer_interval"))
    return bool(layers[i])


def _all_sliding(get, i):  # Mistral, Phi-3: one window for every layer, when set
    return "full_attention" if get("sliding_window") is None else "sliding_attention"


@dataclasses.dataclass(frozen=True)
class Lineage:
    """How one model type writes a Llama-layout model (see the module docstring).

    biases: how bias keys map to use_bias / qkv_bias: "llama" (attention_bias and
      mlp_bias, equal), "attention" (attention_bias on q, k, v, o; no MLP key), "qkv"
      (Qwen2: q, k, v always), "none".
    layer_type(get, i): layer i's type when config.json lists no layer_types (None: the
      family has no layer types; every layer full attention).
    rope_of(get, i): whether layer i is rotated (NoPE layers); None: all are.
    rope_per_type: rope_parameters keyed by layer type (Gemma 3, OLMo 3), with its legacy
      keys and defaults (type -> theta; legacy key -> type).
    extra(get) -> more ModelConfig fields (multipliers, soft-caps, Gemma's scale);
    extra_to_hf(cfg) -> their config.json keys.
    """

    norm: str = "rmsnorm"
    block: str = "pre_ln"
    qk_norm: str = "none"
    biases: str = "llama"
    act_key: str = "hidden_act"
    eps_key: str = "rms_norm_eps"
    layer_type: Callable | None = None
    layer_types_key: bool = False   # the family's config.json may list layer_types
    rope_of: Callable | None = None
    rope_per_type: dict | None = None
    partial_rotary: bool = False
    extra: Callable[[Callable], dict] = lambda get: {}
    extra_to_hf: Callable[[ModelConfig], dict] = lambda cfg: {}
    refuse: tuple[tuple[str, Any, str], ...] = ()  # (key, the only value read, why)
    rope_scalings: tuple[str, ...] | None = None  # the RoPE scalings it takes (None: all)


def _gemma(get) -> dict:
    d = get("hidden_size")
    scalar = get("query_pre_attn_scalar")
    return dict(embed_multiplier=math.sqrt(d),
                attn_scale=None if scalar is None or scalar == _head_dim(get) else scalar ** -0.5)


def _gemma_to_hf(cfg) -> dict:  # embeddings times sqrt(d_model): checked by the round trip
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale ** -2
    if not math.isclose(scalar, round(scalar), rel_tol=1e-9):
        raise cannot("attn_scale", cfg.attn_scale, "Gemma's query_pre_attn_scalar (the scale "
                     "is its -1/2 power) is an integer")
    return dict(query_pre_attn_scalar=round(scalar))


def _gemma2(get) -> dict:
    return dict(_gemma(get), attn_softcap=get("attn_logit_softcapping"),
                final_softcap=get("final_logit_softcapping"))


def _gemma2_to_hf(cfg) -> dict:
    return dict(_gemma_to_hf(cfg), attn_logit_softcapping=cfg.attn_softcap,
                final_logit_softcapping=cfg.final_softcap)


def _gemma3(get) -> dict:
    # Gemma3's attention never applies attn_logit_softcapping (the key is read and unused)
    return dict(_gemma(get), final_softcap=get("final_logit_softcapping"))


def _gemma3_to_hf(cfg) -> dict:
    return dict(_gemma_to_hf(cfg), final_logit_softcapping=cfg.final_softcap,
                attn_logit_softcapping=None)


def _granite(get) -> dict:
    return dict(embed_multiplier=float(get("embedding_multiplier")),
                residual_multiplier=float(get("residual_multiplier")),
                attn_scale=float(get("attention_multiplier")),
                logits_multiplier=1.0 / float(get("logits_scaling")))


def _granite_to_hf(cfg) -> dict:
    return dict(embedding_multiplier=cfg.embed_multiplier,
                residual_multiplier=cfg.residual_multiplier,
                attention_multiplier=cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim),
                logits_scaling=1.0 / cfg.logits_multiplier)


_NO_BIDIRECTIONAL = (("use_bidirectional_attention", (None, False), "jaxformer's attention "
                      "is causal"),)
LINEAGE: dict[str, Lineage] = {
    "llama": Lineage(),
    "mistral": Lineage(biases="none", layer_type=_all_sliding),
    "qwen2": Lineage(biases="qkv", layer_type=_qwen_types, layer_types_key=True),
    "qwen3": Lineage(qk_norm="head", biases="attention", layer_type=_qwen_types,
                     layer_types_key=True),
    # Phi3Config takes only default RoPE or longrope (it reads yarn and su as longrope)
    "phi3": Lineage(biases="none", layer_type=_all_sliding, partial_rotary=True,
                    rope_scalings=("none",)),
    "smollm3": Lineage(layer_type=_smollm3_types, layer_types_key=True, rope_of=_smollm3_rope),
    "granite": Lineage(extra=_granite, extra_to_hf=_granite_to_hf),
    "olmo2": Lineage(block="res_post_ln", qk_norm="projection", biases="attention"),
    "olmo3": Lineage(block="res_post_ln", qk_norm="projection", biases="attention",
                     layer_type=_every(4), layer_types_key=True,
                     rope_per_type=dict(defaults={"full_attention": 5e5, "sliding_attention": 5e5},
                                        legacy={"rope_theta": "full_attention"})),
    "gemma": Lineage(norm="rmsnorm_offset", biases="attention", extra=_gemma,
                     extra_to_hf=_gemma_to_hf, refuse=_NO_BIDIRECTIONAL),
    "gemma2": Lineage(norm="rmsnorm_offset", block="sandwich", biases="attention",
                      act_key="hidden_activation", layer_type=_every(2), layer_types_key=True,
                      extra=_gemma2, extra_to_hf=_gemma2_to_hf, refuse=_NO_BIDIRECTIONAL),
    "gemma3_text": Lineage(
        norm="rmsnorm_offset", block="sandwich", qk_norm="head", biases="attention",
        act_key="hidden_activation", layer_type=_from_key("sliding_window_pattern", 6),
        layer_types_key=True, extra=_gemma3, extra_to_hf=_gemma3_to_hf,
        rope_per_type=dict(defaults={"full_attention": 1e6, "sliding_attention": 1e4},
                           legacy={"rope_theta": "full_attention",
                                   "rope_local_base_freq": "sliding_attention"}),
        refuse=_NO_BIDIRECTIONAL),
    "cohere2": Lineage(norm="layernorm", block="parallel_shared_ln", biases="attention",
                       eps_key="layer_norm_eps", layer_type=_from_key("sliding_window_pattern", 4),
                       layer_types_key=True, rope_of=None,
                       extra=lambda get: dict(logits_multiplier=float(get("logit_scale"))),
                       extra_to_hf=lambda cfg: dict(logit_scale=cfg.logits_multiplier)),
}
# Cohere2 rotates only its sliding layers (its full-attention layers are NoPE), adjacent
# pairs (2i, 2i+1): the tensors are permuted to jaxformer's half layout (convert.tensors).
NOPE_FULL = {"cohere2"}


def _head_dim(get) -> int:
    return get("head_dim") or get("hidden_size") // get("num_attention_heads")


def _biases(get, model_type: str, lineage: Lineage) -> tuple[bool, bool]:
    """(use_bias, qkv_bias) from the family's bias keys."""
    if lineage.biases == "qkv":
        return False, True
    if lineage.biases == "none":
        return False, False
    attention = bool(get("attention_bias"))
    mlp = bool(get("mlp_bias")) if lineage.biases == "llama" else False
    if attention != mlp:
        raise ConfigError(
            f"config.json attention_bias={attention} with mlp_bias={mlp} is not supported for "
            f"{model_type}: jaxformer's use_bias puts biases on every linear layer (q, k, v, o "
            "and the MLP) or on none (qkv_bias alone covers q, k, v only, as Qwen2)")
    return attention, attention


def lineage_from_hf(hf, get, model_type: str) -> ModelConfig:
    """The ModelConfig of a Llama-lineage config.json (`get` reads a key or its default)."""
    lineage = LINEAGE[model_type]
    for key, allowed, why in lineage.refuse:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({model_type})")
    act = get(lineage.act_key)
    if model_type == "gemma" and act == "gelu":  # GemmaConfig rewrites it so
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise unsupported(lineage.act_key, act, f"{model_type}'s MLP in jaxformer is silu "
                          "(SwiGLU) or gelu_pytorch_tanh / gelu_new (GeGLU, tanh GELU)")
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    use_bias, qkv_bias = _biases(get, model_type, lineage)
    fraction = _fraction(hf) if lineage.partial_rotary else None
    if lineage.rope_per_type:
        ropes = rope_per_type_from_hf(hf, get, max_len, **lineage.rope_per_type)
    else:
        theta, scaling = rope_from_hf(hf, get, max_len, fraction=fraction)
        ropes = {"full_attention": (theta, scaling), "sliding_attention": (theta, scaling)}
        if lineage.rope_scalings is not None and scaling.kind not in lineage.rope_scalings:
            raise unsupported("rope_parameters.rope_type", rope_dict(theta, scaling)["rope_type"],
                              f"transformers' {model_type} config takes no such RoPE scaling "
                              "(Phi-3: default, or longrope, which jaxformer lacks)")
    fields = dict(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=_head_dim(get),
        d_ff=get("intermediate_size"), max_seq_len=max_len, position="rope",
        rope_fraction=fraction or 1.0, norm=lineage.norm, norm_eps=float(get(lineage.eps_key)),
        block=lineage.block, qk_norm=lineage.qk_norm, ffn=ACTIVATIONS[act], use_bias=use_bias,
        qkv_bias=qkv_bias, tie_embeddings=bool(get("tie_word_embeddings")))
    fields.update(layer_fields(hf, get, model_type, lineage, ropes))
    fields.update(lineage.extra(get))
    return ModelConfig(**fields)


def _fraction(hf) -> float:
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    value = (hf.get(key) or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise unsupported("partial_rotary_factor", value, "it must be in (0, 1]")
    return float(value)


def lineage_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of a Llama-lineage model type; what the type cannot say is caught
    by the round trip in hf_config.config_to_hf."""
    lineage = LINEAGE[model_type]
    acts = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}  # others show in the round trip
    out = dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
               attention_dropout=0.0, initializer_range=0.02)
    out[lineage.act_key] = acts.get(cfg.ffn, "silu")
    out[lineage.eps_key] = cfg.norm_eps
    if lineage.biases == "llama":
        out.update(attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias)
    elif lineage.biases == "attention":
        out.update(attention_bias=cfg.use_bias)
    out.update(layers_to_hf(cfg, model_type, lineage))
    if not lineage.rope_per_type:
        rope = _one_rope(cfg)
        if lineage.partial_rotary:
            rope["partial_rotary_factor"] = cfg.rope_fraction
        out.update(rope_parameters=rope, rope_theta=rope["rope_theta"],
                   rope_scaling=None if rope["rope_type"] == "default" else
                   {k: v for k, v in rope.items() if k != "rope_theta"})
    else:
        out.update(rope_parameters=rope_per_type_to_hf(cfg))
    out.update(lineage.extra_to_hf(cfg))
    return out


def _one_rope(cfg: ModelConfig) -> dict:
    """The RoPE of the model's rotated layers, which must be one."""
    rotated = {(k.rope_theta, k.rope_scaling) for k in cfg.kinds if k.rope}
    if len(rotated) > 1:
        raise cannot("layer_kinds", "several RoPE bases", "this family has one RoPE for "
                     "every layer")
    theta, scaling = rotated.pop() if rotated else (cfg.rope_theta, cfg.rope_scaling)
    return rope_dict(theta, scaling)
