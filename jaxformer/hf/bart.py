"""BART's own layout (BartForConditionalGeneration): its config.json keys and its tensors,
both ways.

An encoder-decoder (model.arch=encoder_decoder) with post-LN blocks (LayerNorm, eps 1e-5,
which BART has no key for), learned absolute positions with a table of each stack's own,
a LayerNorm on each stack's embeddings (layernorm_embedding: model.embed_norm), token
embeddings scaled by sqrt(d_model) where scale_embedding (model.embed_multiplier), biases
on every projection, the FFN of activation_function (gelu: the exact erf GELU), one input
table shared by the encoder and the decoder (model.shared.weight), the LM head tied to it
(model.tie_embeddings), plus final_logits_bias (model.head_bias).

Positions: BART's table has two rows more than max_position_embeddings, position p reading
row p + 2 (BartLearnedPositionalEmbedding's offset); rows 2.. are imported as positions
0.., and written back after two zero rows, which no position reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxformer.hf.bert import ACTIVATIONS, norm_rules
from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Rule, copied, linear, reshaped
from jaxformer.model.archs import ARCHS, ENCODER_DECODER
from jaxformer.model.config import ModelConfig

OFFSET = 2  # BartLearnedPositionalEmbedding: position p reads row p + 2
EPS = 1e-5  # nn.LayerNorm's default, which every BART norm uses
# the stacks' copies of model.shared.weight that older (tied) checkpoints hold
BUFFERS = (r"model\.(encoder|decoder)\.embed_tokens\.weight",)
TOKENS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)


def read_config(hf, get, row) -> ModelConfig:
    act = get("activation_function")
    if act not in ACTIVATIONS:
        raise unsupported("activation_function", act, "bart's MLP in jaxformer is gelu (exact "
                          "erf: gelu_exact), gelu_new (tanh: gelu) or relu")
    if get("is_encoder_decoder") is not True or get("is_decoder"):
        raise unsupported("is_encoder_decoder", get("is_encoder_decoder"), "jaxformer reads "
                          "BartForConditionalGeneration (is_encoder_decoder true, is_decoder "
                          "false)")
    for encoder, decoder in (("encoder_ffn_dim", "decoder_ffn_dim"),
                             ("encoder_attention_heads", "decoder_attention_heads")):
        if get(encoder) != get(decoder):
            raise unsupported(decoder, get(decoder), f"jaxformer's encoder and decoder share "
                              f"it; {encoder} is {get(encoder)}")
    d, n_heads = get("d_model"), get("decoder_attention_heads")
    return ModelConfig(
        arch=ENCODER_DECODER, encoder_layers=get("encoder_layers"),
        n_layers=get("decoder_layers"), vocab_size=get("vocab_size"), d_model=d,
        n_heads=n_heads, n_kv_heads=n_heads, d_ff=get("decoder_ffn_dim"),
        max_seq_len=get("max_position_embeddings"), position="learned", norm="layernorm",
        norm_eps=EPS, block="post_ln", ffn=ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=get("tie_word_embeddings") is not False, embed_norm=True,
        head_bias=True, embed_multiplier=math.sqrt(d) if get("scale_embedding") else 1.0)


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """BART's keys; what BART lacks (RoPE, RMSNorm, pre-LN...) shows in the round trip."""
    if not ARCHS[cfg.arch].cross_attention:
        raise cannot("arch", cfg.arch, f"{row.name} is an encoder-decoder")
    acts = {ours: theirs for theirs, ours in ACTIVATIONS.items()}
    if cfg.ffn not in acts:
        raise cannot("ffn", cfg.ffn, f"{row.name}'s activation_function has "
                     f"{', '.join(ACTIVATIONS)}")
    scaled = math.isclose(cfg.embed_multiplier, math.sqrt(cfg.d_model), rel_tol=1e-9)
    if not scaled and cfg.embed_multiplier != 1.0:
        raise cannot("embed_multiplier", cfg.embed_multiplier, f"{row.name} scales its "
                     "embeddings by sqrt(d_model) or not at all")
    layers = dict(ffn_dim=cfg.d_ff, attention_heads=cfg.n_heads, layerdrop=0.0)
    keys = {f"{stack}_{k}": v for stack in ("encoder", "decoder") for k, v in layers.items()}
    keys.update(encoder_layers=cfg.encoder_n_layers, decoder_layers=cfg.n_layers)
    return dict(keys, d_model=cfg.d_model, activation_function=acts[cfg.ffn],
                max_position_embeddings=cfg.max_seq_len, scale_embedding=scaled,
                is_encoder_decoder=True, is_decoder=False, dropout=cfg.dropout,
                attention_dropout=0.0, activation_dropout=0.0, init_std=0.02,
                forced_eos_token_id=None, **TOKENS)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    if rope_layout != "half":
        raise ValueError("rope_layout applies to RoPE models; BART has learned positions")
    d, v, m = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rules = [embedding_rule(cfg, v, d, m)]
    for stack, layers, cross in (("encoder", cfg.encoder_n_layers, False),
                                 ("decoder", cfg.n_layers, True)):
        rules += [positions_rule(cfg, stack, f"{m}{stack}.embed_positions.weight"),
                  *norm_rules((stack, "embed_norm"), f"{m}{stack}.layernorm_embedding", d)]
        for i in range(layers):
            rules += block_rules(cfg, stack, i, f"{m}{stack}.layers.{i}.", cross)
    rules.append(reshaped(("decoder", "head_bias"), "final_logits_bias", (1, v), (v,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("decoder", "lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def embedding_rule(cfg: ModelConfig, v: int, d: int, m: str) -> Rule:
    """Tied: model.shared.weight, the one table (the stacks' embed_tokens of older files
    are copies of it). Untied, as transformers ties nothing: the encoder's embed_tokens
    (source_embed) and the decoder's (embed); model.shared, which no forward reads, is
    written as the decoder's."""
    if cfg.tie_embeddings:
        return copied(("embed", "embedding"), f"{m}shared.weight", (v, d))
    return Rule((("embed", "embedding"), ("source_embed", "embedding")),
                tuple(f"{m}{t}.weight" for t in ("shared", "encoder.embed_tokens",
                                                 "decoder.embed_tokens")),
                ((v, d),) * 3, lambda shared, source, target: (target, source),
                lambda target, source: (target, source, target))


def positions_rule(cfg: ModelConfig, stack: str, name: str) -> Rule:
    """A stack's table [max_seq_len + 2, D]: rows 2.. are positions 0.. (rows 0, 1 unused,
    written as zeros)."""
    t, d = cfg.max_seq_len, cfg.d_model
    return Rule(((stack, "pos_embed", "embedding"),), (name,), ((t + OFFSET, d),),
                lambda w: (w[OFFSET:],),
                lambda p: (np.concatenate([np.zeros((OFFSET, d), p.dtype), p]),))


def block_rules(cfg: ModelConfig, stack: str, i: int, p: str, cross: bool) -> list[Rule]:
    """Layer i of a stack: self-attention, (the decoder's: cross) cross-attention, the
    FFN, each followed by its norm."""
    b, d, f = (stack, f"block_{i}"), cfg.d_model, cfg.d_ff
    sublayers = [("attn", "attn_norm", "self_attn")]
    if cross:
        sublayers.append(("cross_attn", "cross_norm", "encoder_attn"))
    rules = []
    for ours, norm, theirs in sublayers:
        rules += attention_rules(cfg, b + (ours,), f"{p}{theirs}.")
        rules += norm_rules(b + (norm,), f"{p}{theirs}_layer_norm", d)
    return rules + [
        linear(b + ("ffn", "wi", "kernel"), f"{p}fc1.weight", (f, d), (d, f)),
        copied(b + ("ffn", "wi", "bias"), f"{p}fc1.bias", (f,)),
        linear(b + ("ffn", "wo", "kernel"), f"{p}fc2.weight", (d, f), (f, d)),
        copied(b + ("ffn", "wo", "bias"), f"{p}fc2.bias", (d,)),
        *norm_rules(b + ("ffn_norm",), f"{p}final_layer_norm", d)]


def attention_rules(cfg: ModelConfig, ours: tuple, theirs: str) -> list[Rule]:
    """q, k, v [N * H, D] with biases [N * H]; out_proj [D, N * H] with its bias [D]."""
    d, n, h = cfg.d_model, cfg.n_heads, cfg.head_dim
    rules = []
    for x, y in (("query", "q"), ("key", "k"), ("value", "v")):
        rules += [linear(ours + (x, "kernel"), f"{theirs}{y}_proj.weight", (n * h, d), (d, n, h)),
                  reshaped(ours + (x, "bias"), f"{theirs}{y}_proj.bias", (n * h,), (n, h))]
    return rules + [
        linear(ours + ("out", "kernel"), f"{theirs}out_proj.weight", (d, n * h), (n, h, d)),
        copied(ours + ("out", "bias"), f"{theirs}out_proj.bias", (d,))]
