"""Named model configurations (``ModelConfig.preset(name)``, ``model.preset=NAME``): the
released architectures as data, field -> value."""

from __future__ import annotations

from typing import Any, Mapping

from jaxformer.core.validation import ConfigError

_GPT2 = dict(vocab_size=50257, max_seq_len=1024, position="learned", norm="layernorm",
             norm_eps=1e-5, block="pre_ln", ffn="gelu", use_bias=True, tie_embeddings=True)
_LLAMA = dict(position="rope", norm="rmsnorm", block="pre_ln", ffn="swiglu", use_bias=False,
              tie_embeddings=False)

_GEMMA3_LOCAL = dict(window=512, rope_theta=10000.0)

PRESETS: dict[str, dict[str, Any]] = {
    # Trains on 2 CPU cores in minutes: byte vocabulary, RoPE, pre-LN.
    "tiny": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=256),
    "gpt2-small": dict(_GPT2, d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": dict(_GPT2, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-large": dict(_GPT2, d_model=1280, n_layers=36, n_heads=20),
    "llama2-7b": dict(_LLAMA, vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      d_ff=11008, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": dict(_LLAMA, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                      norm_eps=1e-5),
    "llama3.1-8b": dict(_LLAMA, vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                        n_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                        norm_eps=1e-5,
                        rope_scaling=dict(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_seq_len=8192)),
    # the released configurations of today's open models (their config.json on the Hub)
    "gemma3-1b": dict(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                      head_dim=256, d_ff=6912, max_seq_len=32768, position="rope",
                      rope_theta=1000000.0, norm="rmsnorm_offset", norm_eps=1e-6,
                      block="sandwich", ffn="geglu", use_bias=False, qk_norm="head",
                      tie_embeddings=True, embed_multiplier=1152 ** 0.5,
                      layer_pattern=("local",) * 5 + ("global",),
                      layer_kinds={"local": _GEMMA3_LOCAL, "global": {}}),
    "qwen3-0.6b": dict(_LLAMA, vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                       n_kv_heads=8, head_dim=128, d_ff=3072, max_seq_len=40960,
                       rope_theta=1000000.0, norm_eps=1e-6, qk_norm="head",
                       tie_embeddings=True),
    "olmo2-1b": dict(_LLAMA, vocab_size=100352, d_model=2048, n_layers=16, n_heads=16,
                     d_ff=8192, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-6,
                     block="res_post_ln", qk_norm="projection"),
    "pythia-160m": dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                        max_seq_len=2048, position="rope", rope_fraction=0.25, norm="layernorm",
                        norm_eps=1e-5, block="parallel", ffn="gelu_exact", use_bias=True,
                        tie_embeddings=False),
}


def preset_values(name: str, overrides: dict) -> dict[str, Any]:
    """Preset `name`'s fields with `overrides` on top (a rope_scaling mapping merged into the
    preset's); an unknown name is refused in one line."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}")
    values = {**PRESETS[name], **overrides}
    if isinstance(overrides.get("rope_scaling"), Mapping) and \
            isinstance(PRESETS[name].get("rope_scaling"), Mapping):
        values["rope_scaling"] = {**PRESETS[name]["rope_scaling"], **overrides["rope_scaling"]}
    return values
