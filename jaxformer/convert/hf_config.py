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

import dataclasses
import math
from typing import Any, Mapping

from jaxformer.config import RUNTIME, ConfigError, ModelConfig
from jaxformer.convert.hf_llama import LINEAGE, lineage_from_hf, lineage_to_hf
from jaxformer.convert.hf_rope import cannot, rope_from_hf, rope_to_hf, unsupported

# model_type -> the architectures whose weights we read (an LM head, or the bare model).
ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXModel"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
    "phi3": ("Phi3ForCausalLM", "Phi3Model"),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Model"),
    "granite": ("GraniteForCausalLM", "GraniteModel"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Model"),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Model"),
    "gemma": ("GemmaForCausalLM", "GemmaModel"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Model"),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Model"),
}
# model_type -> its family: the tensor layout (convert.tensors) and config reader/writer.
FAMILIES = {"gpt2": "gpt2", "gpt_neox": "gpt_neox", **{t: "llama" for t in LINEAGE}}
# Model types that are another model (MoE, multimodal, a different block): named when refused.
OTHER_MODELS = {"qwen3_moe": "Qwen3's mixture of experts", "qwen2_moe": "a mixture of experts",
                "gemma3": "Gemma 3 with vision (a Gemma3ForConditionalGeneration; its text "
                "model alone is model_type gemma3_text)", "gemma3n": "Gemma 3n",
                "olmoe": "a mixture of experts", "olmo": "OLMo 1 (non-parametric LayerNorm)",
                "cohere": "Cohere 1 (Command-R)", "phimoe": "a mixture of experts",
                "granitemoe": "a mixture of experts", "mixtral": "a mixture of experts"}
# The order config_to_hf tries model types in: the first that expresses a model writes it.
EXPORT_ORDER = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3",
                "granite", "olmo2", "olmo3", "gemma", "gemma2", "gemma3_text", "cohere2")
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
    "qwen3": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  head_dim=128, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28, rope_theta=10000.0),
    "phi3": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                 head_dim=None, rope_theta=10000.0),
    "smollm3": dict(num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                    mlp_bias=False, head_dim=None, use_sliding_window=False, sliding_window=None,
                    no_rope_layers=None, no_rope_layer_interval=4, rope_theta=2000000.0),
    "granite": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                    mlp_bias=False, head_dim=None, embedding_multiplier=1.0,
                    residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0,
                    rope_theta=10000.0),
    "olmo2": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                  head_dim=None, rope_theta=10000.0),
    "olmo3": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                  head_dim=None, sliding_window=4096),
    "gemma": dict(num_key_value_heads=16, hidden_act="gelu_pytorch_tanh", head_dim=256,
                  max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  attention_bias=False, use_bidirectional_attention=None, rope_theta=10000.0,
                  query_pre_attn_scalar=None),
    "gemma2": dict(num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh", head_dim=256,
                   max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   use_bidirectional_attention=None, rope_theta=10000.0),
    "gemma3_text": dict(num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh",
                        head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
                        sliding_window=4096, sliding_window_pattern=6, final_logit_softcapping=None,
                        use_bidirectional_attention=False),
    "cohere2": dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=8192,
                    layer_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
                    head_dim=None, sliding_window=4096, sliding_window_pattern=4,
                    logit_scale=0.0625, rope_theta=10000.0),
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
        other = f": {OTHER_MODELS[model_type]}," if model_type in OTHER_MODELS else ""
        raise ConfigError(f"unsupported model_type {model_type!r}{other} (architectures "
                          f"{archs}); supported model types are: {', '.join(ARCHITECTURES)}")
    bad = [a for a in archs if a not in ARCHITECTURES[model_type]]
    if bad:
        raise ConfigError(f"unsupported architecture(s) {', '.join(bad)} for model_type "
                          f"{model_type!r}; supported: {', '.join(ARCHITECTURES[model_type])}")
    if model_type in LINEAGE:
        return lineage_from_hf(hf, _reader(hf, model_type), model_type)
    return {"gpt2": _gpt2_from_hf, "gpt_neox": _neox_from_hf}[model_type](hf, model_type)


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
    if not get("attention_bias"):
        raise unsupported("attention_bias", get("attention_bias"), "gpt_neox's MLP always has "
                          "biases, and jaxformer's use_bias puts them on the attention too")
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    fraction = _neox_rotary_fraction(hf, get)
    theta, scaling = rope_from_hf(hf, get, max_len, theta_key="rotary_emb_base",
                                  fraction=fraction)
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=n_heads, d_ff=get("intermediate_size"), max_seq_len=max_len,
        position="rope", rope_theta=float(theta), rope_scaling=scaling,
        rope_fraction=float(fraction), norm="layernorm", norm_eps=float(get("layer_norm_eps")),
        block="parallel" if get("use_parallel_residual") else "pre_ln",
        ffn=NEOX_ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")))


def _neox_rotary_fraction(hf, get) -> float:
    """The share of each head GPT-NeoX rotates (Pythia: 0.25), read as transformers 5
    reads it: rope_parameters' (or 4.x's rope_scaling's) partial_rotary_factor, else
    rotary_pct (a top-level partial_rotary_factor is not read by GPTNeoXConfig)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    name, value = ((f"{key}.partial_rotary_factor", params["partial_rotary_factor"])
                   if "partial_rotary_factor" in params else ("rotary_pct", get("rotary_pct")))
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise unsupported(name, value, "the rotary fraction must be in (0, 1]")
    return float(value)


# ---- ModelConfig -> config.json ---------------------------------------------------


_PER_LAYER = ("layer_pattern", "layer_kinds", "sliding_window", "rope_theta", "rope_scaling")


def _layers(cfg: ModelConfig) -> list:
    """Each layer's attention as it computes: its window, and its RoPE where it rotates."""
    out = []
    for i in cfg.layer_kind_ids:
        k = cfg.kinds[i]
        rope = (k.rope_theta, k.rope_scaling) if cfg.position == "rope" and k.rope else None
        out.append((k.window, rope))
    return out


def differences(cfg: ModelConfig, other: ModelConfig) -> list[str]:
    """The fields in which `other` computes differently from cfg (the runtime fields and
    the spelling of a layer pattern aside; numbers equal to 1e-9 relative)."""
    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-9)
        return a == b
    diffs = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME +
             _PER_LAYER and not same(getattr(cfg, f.name), getattr(other, f.name))]
    if _layers(cfg) != _layers(other):
        diffs.append("layer_kinds" if cfg.layer_pattern else "sliding_window"
                     if {w for w, _ in _layers(cfg)} != {w for w, _ in _layers(other)}
                     else "rope_theta / rope_scaling")
    return diffs


def export_model_type(cfg: ModelConfig) -> str:
    """The first model type (EXPORT_ORDER) whose config.json, read back, is cfg's model.
    Writers write what they can (a value a type has no spelling for at all, e.g. NTK
    scaling, raises); the round trip finds the rest. A model no type writes is a
    ConfigError naming the fields of the nearest type that differ."""
    nearest = None
    for model_type in EXPORT_ORDER:
        try:
            back = config_from_hf(_write(cfg, model_type, "float32"))
        except ConfigError as e:  # the writer (or reader) names the one value it cannot say
            miss = (1, str(e))
        else:
            diffs = differences(cfg, back)
            if not diffs:
                return model_type
            miss = (len(diffs), f"model.{diffs[0]}={getattr(cfg, diffs[0].split()[0])!r} "
                    f"cannot be written as a Hugging Face checkpoint: no supported model type "
                    f"expresses it (the nearest, {model_type}, differs in {', '.join(diffs)})")
        if nearest is None or miss[0] < nearest[0]:
            nearest = miss
    raise ConfigError(nearest[1])


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A config.json (as a dict) that transformers reads as the same model."""
    return _write(cfg, export_model_type(cfg), dtype)


def _write(cfg: ModelConfig, model_type: str, dtype: str) -> dict[str, Any]:
    arch = ARCHITECTURES[model_type][0]
    common = dict(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, dtype=dtype, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, use_cache=True)
    if model_type in LINEAGE:
        return dict(common, **lineage_to_hf(cfg, model_type))
    return dict(common, **{"gpt2": _gpt2_to_hf, "gpt_neox": _neox_to_hf}[model_type](
        cfg, model_type))


def _gpt2_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """GPT-2's keys; what GPT-2 lacks (RMSNorm, GQA, a window...) shows in the round trip."""
    acts = {"gelu": "gelu_new", "relu": "relu"}
    return dict(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                n_positions=cfg.max_seq_len, activation_function=acts.get(cfg.ffn, "gelu_new"),
                layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attn_pdrop=0.0, initializer_range=0.02)


def _neox_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """GPT-NeoX's keys; what it lacks (GQA, a window, bias-free layers...) shows in the
    round trip."""
    acts = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
    rope = dict(rope_to_hf(cfg), partial_rotary_factor=cfg.rope_fraction)
    return dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                hidden_act=acts.get(cfg.ffn, "gelu"), max_position_embeddings=cfg.max_seq_len,
                layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.block == "parallel",
                attention_bias=True, rope_parameters=rope, attention_dropout=0.0,
                hidden_dropout=cfg.dropout, initializer_range=0.02,
                # transformers 4.x reads these instead of rope_parameters
                rotary_pct=cfg.rope_fraction, rotary_emb_base=cfg.rope_theta,
                rope_scaling=None if rope["rope_type"] == "default" else
                {k: v for k, v in rope.items() if k not in ("rope_theta",
                                                            "partial_rotary_factor")})
