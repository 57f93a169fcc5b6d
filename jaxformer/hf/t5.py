"""T5's own layout (T5ForConditionalGeneration): its config.json keys and its tensors, both
ways.

An encoder-decoder (model.arch=encoder_decoder) with pre-LN blocks, RMSNorm without the
mean (T5LayerNorm, no bias), no biases anywhere, T5's relative-position bias (position t5)
computed in each stack's first layer and shared by its layers (bidirectional buckets in
the encoder, causal ones in the decoder, none on cross-attention), no 1/sqrt(head_dim)
scaling of the attention logits (model.attn_scale 1), one input table shared by the
encoder and the decoder (shared.weight; with v1.1's head of its own, jaxformer's
model.tie_source_embed), and the FFN of feed_forward_proj: relu (v1.0),
gated-gelu (v1.1: the tanh GELU, jaxformer's geglu), gated-silu, gelu, gelu_new.

The output scale: T5 v1.0 multiplies the decoder's output by d_model ** -0.5 before its
head (tied to the embeddings); v1.1 does not (its head is its own). transformers 5 says so
in scale_decoder_outputs (and always ties the head unless the checkpoint's lm_head.weight
differs); older files by tie_word_embeddings alone. jaxformer: model.logits_multiplier.
"""

from __future__ import annotations

import math
from typing import Any

from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Rule, copied, linear
from jaxformer.model.archs import ARCHS, ENCODER_DECODER
from jaxformer.model.config import ModelConfig
from jaxformer.positions.biases import T5Settings

# feed_forward_proj -> model.ffn ("gated-gelu" is the tanh GELU, as T5Config rewrites it)
FFN_PROJ = {"relu": "relu", "gated-gelu": "geglu", "gated-gelu_new": "geglu",
            "gated-silu": "swiglu", "gelu": "gelu_exact", "gelu_new": "gelu"}
FFN_TO_HF = {"relu": "relu", "geglu": "gated-gelu", "swiglu": "gated-silu",
             "gelu_exact": "gelu", "gelu": "gelu_new"}
POSITIONS = 512  # n_positions: T5 has no position limit; older config.json files say 512
# the stacks' copies of shared.weight that older checkpoints hold
BUFFERS = (r"(encoder|decoder)\.embed_tokens\.weight",)


def scales_output(hf, get) -> bool:
    """Whether the decoder's output is scaled by d_model ** -0.5: scale_decoder_outputs
    (transformers 5), else tie_word_embeddings (the older files' only say)."""
    if "scale_decoder_outputs" in hf:
        return bool(hf["scale_decoder_outputs"])
    return get("tie_word_embeddings") is not False


def read_config(hf, get, row) -> ModelConfig:
    proj = get("feed_forward_proj")
    if proj not in FFN_PROJ:
        raise unsupported("feed_forward_proj", proj, f"jaxformer reads {', '.join(FFN_PROJ)}")
    if get("is_encoder_decoder") is not True or get("is_decoder"):
        raise unsupported("is_encoder_decoder", get("is_encoder_decoder"), "jaxformer reads "
                          "T5ForConditionalGeneration (is_encoder_decoder true, is_decoder false)")
    d, n_heads, encoder = get("d_model"), get("num_heads"), get("num_layers")
    return ModelConfig(
        arch=ENCODER_DECODER, encoder_layers=encoder, n_layers=get("num_decoder_layers") or encoder,
        vocab_size=get("vocab_size"), d_model=d, n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=get("d_kv"), d_ff=get("d_ff"), max_seq_len=get("n_positions"),
        position="t5", position_settings=dict(
            num_buckets=get("relative_attention_num_buckets"),
            max_distance=get("relative_attention_max_distance")), norm="rmsnorm",
        norm_eps=float(get("layer_norm_epsilon")), block="pre_ln", ffn=FFN_PROJ[proj],
        use_bias=False, qkv_bias=False, attn_scale=1.0,
        tie_embeddings=get("tie_word_embeddings") is not False,
        tie_source_embed=get("tie_word_embeddings") is False,  # one input table, always
        logits_multiplier=d ** -0.5 if scales_output(hf, get) else 1.0)


def buckets(cfg: ModelConfig) -> T5Settings:
    """cfg's T5 buckets; another scheme's model (written as T5 only to be compared, the
    round trip naming its position) the defaults."""
    s = cfg.position_settings
    return s if isinstance(s, T5Settings) else T5Settings()


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """T5's keys; what T5 lacks (RoPE, biases, another norm...) shows in the round trip."""
    if not ARCHS[cfg.arch].cross_attention:
        raise cannot("arch", cfg.arch, f"{row.name} is an encoder-decoder")
    if cfg.ffn not in FFN_TO_HF:
        raise cannot("ffn", cfg.ffn, f"{row.name}'s feed_forward_proj has "
                     f"{', '.join(FFN_TO_HF)}")
    scaled = math.isclose(cfg.logits_multiplier, cfg.d_model ** -0.5, rel_tol=1e-9)
    if not scaled and cfg.logits_multiplier != 1.0:
        raise cannot("logits_multiplier", cfg.logits_multiplier, f"{row.name} scales its "
                     "output by d_model ** -0.5 or not at all")
    return dict(d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff, num_heads=cfg.n_heads,
                num_layers=cfg.encoder_n_layers, num_decoder_layers=cfg.n_layers,
                relative_attention_num_buckets=buckets(cfg).num_buckets,
                relative_attention_max_distance=buckets(cfg).max_distance,
                layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=FFN_TO_HF[cfg.ffn],
                is_encoder_decoder=True, is_decoder=False, scale_decoder_outputs=scaled,
                n_positions=cfg.max_seq_len, dropout_rate=cfg.dropout, initializer_factor=1.0,
                decoder_start_token_id=0, pad_token_id=0)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    if rope_layout != "half":
        raise ValueError("rope_layout applies to RoPE models; T5 has a relative bias")
    d, v = cfg.d_model, cfg.vocab_size
    # the one input table (untied: model.tie_source_embed; a config with source and target
    # tables of their own is not T5's, refused before any tensor)
    rules = [copied(("embed", "embedding"), "shared.weight", (v, d))]
    for stack, layers, cross in (("encoder", cfg.encoder_n_layers, False),
                                 ("decoder", cfg.n_layers, True)):
        rules.append(copied((stack, "position_bias", "relative_bias"),
                            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
                            ".weight", (buckets(cfg).num_buckets, cfg.n_heads)))
        for i in range(layers):
            rules += block_rules(cfg, stack, i, cross)
        rules.append(copied((stack, "final_norm", "scale"), f"{stack}.final_layer_norm.weight",
                            (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("decoder", "lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def block_rules(cfg: ModelConfig, stack: str, i: int, cross: bool) -> list[Rule]:
    """Layer i of a stack: self-attention, (the decoder's: cross) cross-attention, the
    FFN, each with its norm."""
    b, p = (stack, f"block_{i}"), f"{stack}.block.{i}.layer."
    sublayers = [("attn", "attn_norm", "SelfAttention")]
    if cross:
        sublayers.append(("cross_attn", "cross_norm", "EncDecAttention"))
    rules = []
    for j, (ours, norm, theirs) in enumerate(sublayers):
        rules += attention_rules(cfg, b + (ours,), f"{p}{j}.{theirs}.")
        rules.append(copied(b + (norm, "scale"), f"{p}{j}.layer_norm.weight", (cfg.d_model,)))
    ffn, j = f"{p}{len(sublayers)}.", len(sublayers)
    d, f = cfg.d_model, cfg.d_ff
    kernels = ([("wi_gate", "wi_0"), ("wi_up", "wi_1")] if cfg.gated_ffn else [("wi", "wi")])
    rules += [linear(b + ("ffn", ours, "kernel"), f"{ffn}DenseReluDense.{theirs}.weight",
                     (f, d), (d, f)) for ours, theirs in kernels]
    rules += [linear(b + ("ffn", "wo", "kernel"), f"{ffn}DenseReluDense.wo.weight", (d, f), (f, d)),
              copied(b + ("ffn_norm", "scale"), f"{p}{j}.layer_norm.weight", (d,))]
    return rules


def attention_rules(cfg: ModelConfig, ours: tuple, theirs: str) -> list[Rule]:
    """q, k, v [N * H, D] and o [D, N * H], no biases."""
    d, n, h = cfg.d_model, cfg.n_heads, cfg.head_dim
    rules = [linear(ours + (x, "kernel"), f"{theirs}{y}.weight", (n * h, d), (d, n, h))
             for x, y in (("query", "q"), ("key", "k"), ("value", "v"))]
    rules.append(linear(ours + ("out", "kernel"), f"{theirs}o.weight", (d, n * h), (n, h, d)))
    return rules
