"""Hugging Face config.json <-> ModelConfig, for GPT-2, GPT-NeoX (Pythia's family, with
sequential residuals and full rotary) and the Llama family (Llama 2/3, Mistral, Qwen2).

Every field that changes what the model computes is read or written explicitly; a value
jaxformer cannot express exactly is a ConfigError naming the field, never a guess. The
defaults used for keys absent from a config.json are those of transformers 5's config
classes (save_pretrained writes them all, so they matter only for hand-written files),
except for the sizes (vocab, width, depth, heads, MLP, GPT-2's position table): a config.json
without one of them is an error rather than a 7B-sized guess.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxformer.config import ConfigError, ModelConfig
from jaxformer.convert.hf_rope import cannot, rope_from_hf, rope_to_hf, unsupported

# model_type -> the architectures whose weights we read (an LM head, or the bare model).
ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXModel"),
}
# model_type -> its family: the tensor layout (convert.tensors) and config reader/writer.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama",
            "gpt_neox": "gpt_neox"}
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
    # rotary_pct / rotary_emb_base: transformers 4.x's keys, still read by 5 when
    # rope_parameters lacks partial_rotary_factor / rope_theta
    "gpt_neox": dict(hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5,
                     tie_word_embeddings=False, use_parallel_residual=True,
                     attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000.0),
}
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
LLAMA_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
# transformers' "gelu" is the exact (erf) GELU; gelu_new and gelu_pytorch_tanh are the tanh
# approximation, jaxformer's gelu
NEOX_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                    "relu": "relu"}


def model_family(model_type: str) -> str:
    """gpt2, gpt_neox or llama: which tensor layout and config keys a model type uses."""
    return FAMILIES[model_type]


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
    read = {"gpt2": _gpt2_from_hf, "gpt_neox": _neox_from_hf, "llama": _llama_from_hf}
    return read[model_family(model_type)](hf, model_type)


def _gpt2_from_hf(hf, model_type: str) -> ModelConfig:
    get = _reader(hf, model_type)
    act = get("activation_function")
    if act not in GPT2_ACTIVATIONS:
        raise unsupported("activation_function", act, "jaxformer's gelu is the tanh "
                          f"approximation; supported: {', '.join(GPT2_ACTIVATIONS)}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if get(key) != want:
            raise unsupported(key, get(key), f"jaxformer's attention needs {key}={want}")
    # reorder_and_upcast_attn only changes the precision of the scores (jaxformer computes
    # them in float32 anyway), so either value is the same model.
    d = get("n_embd")
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=d, n_layers=get("n_layer"), n_heads=get("n_head"),
        d_ff=get("n_inner") or 4 * d, max_seq_len=get("n_positions"), position="learned",
        norm="layernorm", norm_eps=float(get("layer_norm_epsilon")), block="pre_ln",
        ffn=GPT2_ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")))


def _neox_from_hf(hf, model_type: str) -> ModelConfig:
    get = _reader(hf, model_type)
    act = get("hidden_act")
    if act not in NEOX_ACTIVATIONS:
        raise unsupported("hidden_act", act, "gpt_neox's MLP in jaxformer is gelu (exact erf: "
                          "gelu_exact), gelu_new / gelu_pytorch_tanh (tanh: gelu) or relu")
    if get("use_parallel_residual"):
        raise unsupported("use_parallel_residual", get("use_parallel_residual"), "gpt_neox's "
                          "parallel residual (attention and MLP both read the block input, "
                          "as Pythia) is not supported yet; use_parallel_residual=false is")
    if not get("attention_bias"):
        raise unsupported("attention_bias", get("attention_bias"), "gpt_neox's MLP always has "
                          "biases, and jaxformer's use_bias puts them on the attention too")
    _neox_full_rotary(hf, get)
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    theta, scaling = rope_from_hf(hf, get, max_len, theta_key="rotary_emb_base")
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=n_heads, d_ff=get("intermediate_size"), max_seq_len=max_len,
        position="rope", rope_theta=float(theta), rope_scaling=scaling, norm="layernorm",
        norm_eps=float(get("layer_norm_eps")), block="pre_ln", ffn=NEOX_ACTIVATIONS[act],
        use_bias=True, qkv_bias=True, tie_embeddings=bool(get("tie_word_embeddings")))


def _neox_full_rotary(hf, get) -> None:
    """GPT-NeoX may rotate only a fraction of each head (Pythia: 0.25); jaxformer rotates all
    of it. The fraction is read where transformers 5 reads it: rope_parameters (or 4.x's
    rope_scaling) first, then rotary_pct, then its default."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if "partial_rotary_factor" in params:
        name, value = f"{key}.partial_rotary_factor", params["partial_rotary_factor"]
    elif "partial_rotary_factor" in hf and "rotary_pct" not in hf:
        name, value = "partial_rotary_factor", hf["partial_rotary_factor"]
    else:
        name, value = "rotary_pct", get("rotary_pct")
    if value != 1:
        raise unsupported(name, value, "gpt_neox's partial rotary embedding (a fraction < 1 "
                          "of each head rotated) is not supported yet; jaxformer rotates every "
                          "dimension (1.0)")


def _llama_from_hf(hf, model_type: str) -> ModelConfig:
    get = _reader(hf, model_type)
    act = get("hidden_act")
    if act not in LLAMA_ACTIVATIONS:
        raise unsupported("hidden_act", act, "supported: silu (SwiGLU), gelu_pytorch_tanh / "
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
    theta, scaling = rope_from_hf(hf, get, max_len)
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
    raise unsupported("layer_types", types, "jaxformer applies one attention kind to every "
                      "layer: all full_attention, or all sliding_attention with "
                      "use_sliding_window=true (max_window_layers=0)")


# ---- ModelConfig -> config.json ---------------------------------------------------


def export_model_type(cfg: ModelConfig) -> str:
    """The HF model type that expresses cfg: gpt2 (learned positions), gpt_neox (RoPE,
    LayerNorm and a plain MLP), else llama, mistral (a sliding window) or qwen2 (q/k/v
    biases alone)."""
    if cfg.block != "pre_ln":
        raise cannot("block", cfg.block, "GPT-2, GPT-NeoX and Llama are pre-LN")
    if cfg.position == "learned":
        return "gpt2"
    if cfg.position != "rope":
        raise cannot("position", cfg.position, "GPT-2 has learned positions, GPT-NeoX and "
                     "the Llama family RoPE")
    if cfg.norm == "layernorm" and not cfg.gated_ffn:
        return "gpt_neox"
    if cfg.use_bias and not cfg.qkv_bias:
        raise cannot("qkv_bias", False, "with use_bias=true; Llama's attention_bias covers "
                     "q, k, v and o together")
    if cfg.qkv_bias and not cfg.use_bias:
        return "qwen2"
    if cfg.sliding_window is not None:
        if cfg.use_bias:
            raise cannot("sliding_window", cfg.sliding_window, "Mistral (the Llama variant "
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
    write = {"gpt2": _gpt2_to_hf, "gpt_neox": _neox_to_hf, "llama": _llama_to_hf}
    return dict(common, **write[model_family(model_type)](cfg, model_type))


def _gpt2_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    if cfg.norm != "layernorm":
        raise cannot("norm", cfg.norm, "GPT-2 uses LayerNorm")
    acts = {"gelu": "gelu_new", "relu": "relu"}
    if cfg.ffn not in acts:
        raise cannot("ffn", cfg.ffn, "GPT-2's MLP is gelu or relu")
    if not cfg.use_bias:
        raise cannot("use_bias", False, "GPT-2 has biases on every layer")
    if cfg.n_kv_heads != cfg.n_heads:
        raise cannot("n_kv_heads", cfg.n_kv_heads, "GPT-2 has no grouped-query attention")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise cannot("head_dim", cfg.head_dim, "GPT-2 needs head_dim = d_model / n_heads")
    if cfg.sliding_window is not None:
        raise cannot("sliding_window", cfg.sliding_window, "GPT-2 has no sliding window")
    return dict(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                n_positions=cfg.max_seq_len, activation_function=acts[cfg.ffn],
                layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attn_pdrop=0.0, initializer_range=0.02)


def _neox_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    acts = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
    if cfg.ffn not in acts:
        raise cannot("ffn", cfg.ffn, f"GPT-NeoX's MLP is {', '.join(acts)}")
    for field in ("use_bias", "qkv_bias"):
        if not getattr(cfg, field):
            raise cannot(field, False, "GPT-NeoX's MLP always has biases (and its attention "
                         "bias covers q, k, v and the output together)")
    if cfg.n_kv_heads != cfg.n_heads:
        raise cannot("n_kv_heads", cfg.n_kv_heads, "GPT-NeoX has no grouped-query attention "
                     "(n_kv_heads must equal n_heads)")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise cannot("head_dim", cfg.head_dim, "GPT-NeoX needs head_dim = d_model / n_heads")
    if cfg.sliding_window is not None:
        raise cannot("sliding_window", cfg.sliding_window, "GPT-NeoX has no sliding window")
    rope = dict(rope_to_hf(cfg), partial_rotary_factor=1.0)
    return dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                hidden_act=acts[cfg.ffn], max_position_embeddings=cfg.max_seq_len,
                layer_norm_eps=cfg.norm_eps, use_parallel_residual=False, attention_bias=True,
                rope_parameters=rope, attention_dropout=0.0, hidden_dropout=cfg.dropout,
                initializer_range=0.02,
                # transformers 4.x reads these instead of rope_parameters
                rotary_pct=1.0, rotary_emb_base=cfg.rope_theta,
                rope_scaling=None if rope["rope_type"] == "default" else
                {k: v for k, v in rope.items() if k not in ("rope_theta",
                                                            "partial_rotary_factor")})


def _llama_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    if cfg.norm != "rmsnorm":
        raise cannot("norm", cfg.norm, "the Llama family uses RMSNorm")
    acts = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
    if cfg.ffn not in acts:
        raise cannot("ffn", cfg.ffn, "the Llama family's MLP is gated (swiglu or geglu)")
    rope = rope_to_hf(cfg)
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
