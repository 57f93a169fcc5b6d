"""Hugging Face config.json <-> ModelConfig, for GPT-2 and the Llama family (Llama 2/3,
Mistral, Qwen2).

Every field that changes what the model computes is read or written explicitly; a value
jaxformer cannot express exactly is a ConfigError naming the field, never a guess. The
defaults used for keys absent from a config.json are those of transformers 5's config
classes (save_pretrained writes them all, so they matter only for hand-written files),
except for the sizes (vocab, width, depth, heads, MLP, GPT-2's position table): a config.json
without one of them is an error rather than a 7B-sized guess.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jaxformer.config import ConfigError, ModelConfig, RopeScaling

# model_type -> the architectures whose weights we read (an LM head, or the bare model).
ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
}
_ALL = object()  # a required key: no default

DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 reorder_and_upcast_attn=False, add_cross_attention=False,
                 tie_word_embeddings=True),
    "llama": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False, head_dim=None, rope_theta=10000.0),
    "mistral": dict(num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
                    sliding_window=4096, rope_theta=10000.0),
    "qwen2": dict(num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  layer_types=None, rope_theta=10000.0),
}
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
LLAMA_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
ROPE_KEYS = {  # rope_parameters keys each rope_type may carry
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
}


def model_family(model_type: str) -> str:
    """gpt2 or llama: which tensor layout a model type uses."""
    return "gpt2" if model_type == "gpt2" else "llama"


def _reader(hf: Mapping[str, Any], model_type: str):
    defaults = DEFAULTS[model_type]

    def get(key, default=_ALL):
        if key in hf:
            return hf[key]
        default = defaults.get(key, default)
        if default is _ALL:
            raise ConfigError(f"config.json has no {key!r}, which a {model_type} model needs")
        return default

    return get


def _unsupported(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {key}={value!r} is not supported: {why}")


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a parsed mapping)."""
    model_type = hf.get("model_type")
    archs = list(hf.get("architectures") or [])
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {model_type!r} (architectures {archs}); "
                          f"supported model types are: {', '.join(ARCHITECTURES)}")
    bad = [a for a in archs if a not in ARCHITECTURES[model_type]]
    if bad:
        raise ConfigError(f"unsupported architecture(s) {', '.join(bad)} for model_type "
                          f"{model_type!r}; supported: {', '.join(ARCHITECTURES[model_type])}")
    if model_type == "gpt2":
        return _gpt2_from_hf(hf)
    return _llama_from_hf(hf, model_type)


def _gpt2_from_hf(hf) -> ModelConfig:
    get = _reader(hf, "gpt2")
    act = get("activation_function")
    if act not in GPT2_ACTIVATIONS:
        raise _unsupported("activation_function", act, "jaxformer's gelu is the tanh "
                           f"approximation; supported: {', '.join(GPT2_ACTIVATIONS)}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if get(key) != want:
            raise _unsupported(key, get(key), f"jaxformer's attention needs {key}={want}")
    # reorder_and_upcast_attn only changes the precision of the scores (jaxformer computes
    # them in float32 anyway), so either value is the same model.
    d = get("n_embd")
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=d, n_layers=get("n_layer"), n_heads=get("n_head"),
        d_ff=get("n_inner") or 4 * d, max_seq_len=get("n_positions"), position="learned",
        norm="layernorm", norm_eps=float(get("layer_norm_epsilon")), block="pre_ln",
        ffn=GPT2_ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")))


def _llama_from_hf(hf, model_type: str) -> ModelConfig:
    get = _reader(hf, model_type)
    act = get("hidden_act")
    if act not in LLAMA_ACTIVATIONS:
        raise _unsupported("hidden_act", act, "supported: silu (SwiGLU), gelu_pytorch_tanh / "
                           "gelu_new (GeGLU with jaxformer's tanh gelu)")
    n_heads = get("num_attention_heads")
    if model_type == "qwen2":  # q/k/v biases always, none elsewhere
        use_bias, qkv_bias = False, True
    elif model_type == "mistral":
        use_bias = qkv_bias = False
    else:
        attention_bias, mlp_bias = get("attention_bias"), get("mlp_bias")
        if attention_bias != mlp_bias:
            raise ConfigError(
                f"config.json attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                "supported: jaxformer's use_bias puts biases on every linear layer (q, k, v, o "
                "and the MLP) or on none (qkv_bias alone covers q, k, v only, as Qwen2)")
        use_bias = qkv_bias = bool(attention_bias)
    max_len = get("max_position_embeddings")
    theta, scaling = _rope_from_hf(hf, get, max_len)
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=get("num_key_value_heads") or n_heads,
        head_dim=get("head_dim") or None, d_ff=get("intermediate_size"), max_seq_len=max_len,
        position="rope", rope_theta=float(theta), rope_scaling=scaling, norm="rmsnorm",
        norm_eps=float(get("rms_norm_eps")), block="pre_ln", ffn=LLAMA_ACTIVATIONS[act],
        use_bias=use_bias, qkv_bias=qkv_bias, tie_embeddings=bool(get("tie_word_embeddings")),
        sliding_window=_window_from_hf(get, model_type))


def _window_from_hf(get, model_type: str) -> int | None:
    if model_type == "mistral":
        return get("sliding_window")
    if model_type != "qwen2":
        return None  # Llama has no sliding window
    window = get("sliding_window") if get("use_sliding_window") else None
    types = get("layer_types")
    if types is None:  # transformers' rule: the layers from max_window_layers on slide
        types = ["sliding_attention" if window is not None and i >= get("max_window_layers")
                 else "full_attention" for i in range(get("num_hidden_layers"))]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return window
    raise _unsupported("layer_types", types, "jaxformer applies one attention kind to every "
                       "layer: all full_attention, or all sliding_attention with "
                       "use_sliding_window=true (max_window_layers=0)")


def _rope_from_hf(hf, get, max_len: int) -> tuple[float, RopeScaling]:
    # transformers 5 writes rope_parameters (rope_theta inside); 4.x wrote rope_theta and
    # rope_scaling (null for plain RoPE). Like transformers, rope_scaling wins when both exist.
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(key) or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _unsupported(key, params, "per-layer-type RoPE parameters")
    theta = params.pop("rope_theta", get("rope_theta"))
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "jaxformer rotates every dimension")
    if kind not in ROPE_KEYS:
        raise _unsupported(f"{key}.rope_type", kind, f"supported: {', '.join(ROPE_KEYS)} "
                           "('dynamic' NTK changes with the input length; jaxformer's ntk is "
                           "static)")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise _unsupported(key, dict(params, rope_type=kind),
                           f"unknown key(s) {', '.join(unknown)} for rope_type {kind!r}")
    original = params.get("original_max_position_embeddings", max_len)
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_seq_len=original)
    # yarn, as transformers' _compute_yarn_parameters
    if params.get("truncate", True) is not True:
        raise _unsupported(f"{key}.truncate", params["truncate"], "jaxformer's YaRN rounds the "
                           "correction range (truncate=true)")
    factor = params.get("factor") or max_len / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all:
        m = lambda s: 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0  # noqa: E731
        attention_factor = m(mscale) / m(mscale_all)
    return theta, RopeScaling("yarn", factor=float(factor), original_max_seq_len=original,
                              beta_fast=float(params.get("beta_fast") or 32),
                              beta_slow=float(params.get("beta_slow") or 1),
                              attention_factor=None if attention_factor is None
                              else float(attention_factor))


# ---- ModelConfig -> config.json ---------------------------------------------------


def _cannot(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"model.{field}={value!r} cannot be written as a Hugging Face "
                       f"checkpoint: {why}")


def export_model_type(cfg: ModelConfig) -> str:
    """The HF model type that expresses cfg: gpt2 (learned positions), else llama, mistral
    (a sliding window) or qwen2 (q/k/v biases alone)."""
    if cfg.block != "pre_ln":
        raise _cannot("block", cfg.block, "GPT-2 and Llama are pre-LN")
    if cfg.position == "learned":
        return "gpt2"
    if cfg.position != "rope":
        raise _cannot("position", cfg.position, "GPT-2 has learned positions, the Llama "
                      "family RoPE")
    if cfg.use_bias and not cfg.qkv_bias:
        raise _cannot("qkv_bias", False, "with use_bias=true; Llama's attention_bias covers "
                      "q, k, v and o together")
    if cfg.qkv_bias and not cfg.use_bias:
        return "qwen2"
    if cfg.sliding_window is not None:
        if cfg.use_bias:
            raise _cannot("sliding_window", cfg.sliding_window, "Mistral (the Llama variant "
                          "with a window) has no biases")
        return "mistral"
    return "llama"


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A config.json (as a dict) that transformers reads as the same model."""
    model_type = export_model_type(cfg)
    arch = ARCHITECTURES[model_type][0]
    common = dict(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, dtype=dtype, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, use_cache=True)
    if model_type == "gpt2":
        return dict(common, **_gpt2_to_hf(cfg))
    return dict(common, **_llama_to_hf(cfg, model_type))


def _gpt2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.norm != "layernorm":
        raise _cannot("norm", cfg.norm, "GPT-2 uses LayerNorm")
    acts = {"gelu": "gelu_new", "relu": "relu"}
    if cfg.ffn not in acts:
        raise _cannot("ffn", cfg.ffn, "GPT-2's MLP is gelu or relu")
    if not cfg.use_bias:
        raise _cannot("use_bias", False, "GPT-2 has biases on every layer")
    if cfg.n_kv_heads != cfg.n_heads:
        raise _cannot("n_kv_heads", cfg.n_kv_heads, "GPT-2 has no grouped-query attention")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise _cannot("head_dim", cfg.head_dim, "GPT-2 needs head_dim = d_model / n_heads")
    if cfg.sliding_window is not None:
        raise _cannot("sliding_window", cfg.sliding_window, "GPT-2 has no sliding window")
    return dict(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                n_positions=cfg.max_seq_len, activation_function=acts[cfg.ffn],
                layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attn_pdrop=0.0, initializer_range=0.02)


def _llama_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    if cfg.norm != "rmsnorm":
        raise _cannot("norm", cfg.norm, "the Llama family uses RMSNorm")
    acts = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
    if cfg.ffn not in acts:
        raise _cannot("ffn", cfg.ffn, "the Llama family's MLP is gated (swiglu or geglu)")
    rope = _rope_to_hf(cfg)
    out = dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, hidden_act=acts[cfg.ffn],
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               rope_parameters=rope, attention_dropout=0.0, initializer_range=0.02,
               # transformers 4.x reads these two instead of rope_parameters
               rope_theta=cfg.rope_theta,
               rope_scaling=None if rope["rope_type"] == "default" else
               {k: v for k, v in rope.items() if k != "rope_theta"})
    if model_type == "llama":
        out.update(attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias)
    elif model_type == "mistral":
        out.update(sliding_window=cfg.sliding_window)
    else:
        w = cfg.sliding_window
        out.update(use_sliding_window=w is not None, sliding_window=w, max_window_layers=0,
                   layer_types=["full_attention" if w is None else "sliding_attention"]
                   * cfg.n_layers)
    return out


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    s = cfg.rope_scaling
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta}
    if s.kind == "none":
        return dict(rope, rope_type="default")
    if s.kind == "linear":
        return dict(rope, rope_type="linear", factor=s.factor)
    if s.kind == "llama3":
        return dict(rope, rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_seq_len)
    if s.kind == "yarn":
        rope.update(rope_type="yarn", factor=s.factor, beta_fast=s.beta_fast,
                    beta_slow=s.beta_slow, original_max_position_embeddings=s.original_max_seq_len,
                    truncate=True)
        if s.attention_factor is not None:
            rope["attention_factor"] = s.attention_factor
        return rope
    raise _cannot("rope_scaling.kind", s.kind, "transformers has no static NTK scaling (its "
                  "'dynamic' changes with the input length)")
