"""BERT's own layout (BertForMaskedLM): its config.json keys and its tensors, both ways.

A bidirectional encoder (model.arch=encoder) with post-LN blocks, learned absolute
positions, a LayerNorm on the embeddings (model.embed_norm), the exact (erf) GELU, biases
everywhere, and the masked-LM head: dense + GELU + LayerNorm (model.head_transform), then
the decoder tied to the word embeddings, plus a bias (model.head_bias).

Token types: jaxformer reads token type 0 alone (every token of a single-sentence input);
its embedding is added into the position table on import, and written back as zeros
(both types alike) beside the summed table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxformer.hf.rope import unsupported
from jaxformer.hf.tensors import Rule, copied, linear, reshaped
from jaxformer.model.config import ModelConfig

# transformers' "gelu" is the exact (erf) GELU; gelu_new the tanh approximation
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "relu": "relu"}
TYPES = 2  # type_vocab_size: BERT's two segments (sentence A and B)
# buffers, and the decoder's bias (the same tensor as cls.predictions.bias)
BUFFERS = (r"(bert\.)?embeddings\.(position_ids|token_type_ids)",
           r"cls\.predictions\.decoder\.bias")


def read_config(hf, get, row) -> ModelConfig:
    act = get("hidden_act")
    if act not in ACTIVATIONS:
        raise unsupported("hidden_act", act, "bert's MLP in jaxformer is gelu (exact erf: "
                          "gelu_exact), gelu_new (tanh: gelu) or relu")
    for key, want in (("type_vocab_size", TYPES), ("is_decoder", False),
                      ("add_cross_attention", False)):
        if get(key) != want:
            raise unsupported(key, get(key), f"jaxformer reads bert with {key}={want}")
    n_heads = get("num_attention_heads")
    return ModelConfig(
        arch="encoder", vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_heads,
        d_ff=get("intermediate_size"), max_seq_len=get("max_position_embeddings"),
        position="learned", norm="layernorm", norm_eps=float(get("layer_norm_eps")),
        block="post_ln", ffn=ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")), embed_norm=True,
        head_transform=True, head_bias=True)


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """BERT's keys; what BERT lacks (a decoder, RoPE, GQA...) shows in the round trip."""
    acts = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
    return dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                hidden_act=acts.get(cfg.ffn, "gelu"), max_position_embeddings=cfg.max_seq_len,
                layer_norm_eps=cfg.norm_eps, type_vocab_size=TYPES, is_decoder=False,
                add_cross_attention=False, hidden_dropout_prob=cfg.dropout,
                attention_probs_dropout_prob=0.0, initializer_range=0.02)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    if rope_layout != "half":
        raise ValueError("rope_layout applies to RoPE models; BERT has learned positions")
    d, n, h, f, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    t, e = row.tensor_prefix, f"{row.tensor_prefix}embeddings."
    rules = [copied(("embed", "embedding"), f"{e}word_embeddings.weight", (v, d)),
             Rule((("pos_embed", "embedding"),),
                  (f"{e}position_embeddings.weight", f"{e}token_type_embeddings.weight"),
                  ((cfg.max_seq_len, d), (TYPES, d)),
                  lambda pos, types: (pos + types[0],),  # type 0 folded into the positions
                  lambda pos: (pos, np.zeros((TYPES, d), pos.dtype))),
             *norm_rules("embed_norm", f"{e}LayerNorm", d)]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}encoder.layer.{i}."
        for x in ("query", "key", "value"):
            rules += [linear((b, "attn", x, "kernel"), f"{p}attention.self.{x}.weight",
                             (d, d), (d, n, h)),
                      reshaped((b, "attn", x, "bias"), f"{p}attention.self.{x}.bias",
                               (d,), (n, h))]
        rules += [
            linear((b, "attn", "out", "kernel"), f"{p}attention.output.dense.weight", (d, d),
                   (n, h, d)),
            copied((b, "attn", "out", "bias"), f"{p}attention.output.dense.bias", (d,)),
            *norm_rules((b, "attn_norm"), f"{p}attention.output.LayerNorm", d),
            linear((b, "ffn", "wi", "kernel"), f"{p}intermediate.dense.weight", (f, d), (d, f)),
            copied((b, "ffn", "wi", "bias"), f"{p}intermediate.dense.bias", (f,)),
            linear((b, "ffn", "wo", "kernel"), f"{p}output.dense.weight", (d, f), (f, d)),
            copied((b, "ffn", "wo", "bias"), f"{p}output.dense.bias", (d,)),
            *norm_rules((b, "ffn_norm"), f"{p}output.LayerNorm", d)]
    rules += [linear(("head_transform", "kernel"), "cls.predictions.transform.dense.weight",
                     (d, d), (d, d)),
              copied(("head_transform", "bias"), "cls.predictions.transform.dense.bias", (d,)),
              *norm_rules("head_norm", "cls.predictions.transform.LayerNorm", d),
              copied(("head_bias",), "cls.predictions.bias", (v,))]
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def norm_rules(ours, name: str, d: int) -> list[Rule]:
    """A LayerNorm's weight and bias; ours: the module's path (or its name)."""
    path = (ours,) if isinstance(ours, str) else tuple(ours)
    return [copied(path + ("scale",), f"{name}.weight", (d,)),
            copied(path + ("bias",), f"{name}.bias", (d,))]
