"""GPT-NeoX's own layout (Pythia's family): its config.json keys, with sequential or
parallel residuals and partial rotary, and its tensors (LayerNorms and every linear with
biases, q|k|v fused per head in query_key_value, an untied head named embed_out), both
ways."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxformer.hf.rope import rope_from_hf, rope_to_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import Rule, copied, linear, rope_permutation
from jaxformer.model.config import ModelConfig

# model.block -> use_parallel_residual (GPT-NeoX runs one of the two flows)
PARALLEL_RESIDUAL = {"parallel": True, "pre_ln": False}

# transformers' "gelu" is the exact (erf) GELU; gelu_new and gelu_pytorch_tanh are the tanh
# approximation, jaxformer's gelu
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "relu": "relu"}
# buffers of older (Pythia) checkpoints: causal masks and RoPE tables
BUFFERS = (r"(gpt_neox\.)?layers\.\d+\.attention\.((masked_)?bias|rotary_emb\.inv_freq)",)


def read_config(hf, get, row) -> ModelConfig:
    act = get("hidden_act")
    if act not in ACTIVATIONS:
        raise unsupported("hidden_act", act, f"{row.name}'s MLP in jaxformer is gelu (exact erf: "
                          "gelu_exact), gelu_new / gelu_pytorch_tanh (tanh: gelu) or relu")
    if not get("attention_bias"):
        raise unsupported("attention_bias", get("attention_bias"), f"{row.name}'s MLP always "
                          "has biases, and jaxformer's use_bias puts them on the attention too")
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    fraction = rotary_fraction(hf, get, row.rotary_fraction_key)
    theta, scaling = rope_from_hf(hf, get, max_len, theta_key="rotary_emb_base")
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=n_heads, d_ff=get("intermediate_size"), max_seq_len=max_len,
        position="rope", rope_theta=float(theta), rope_scaling=scaling, rope_fraction=fraction,
        norm="layernorm", norm_eps=float(get("layer_norm_eps")),
        block="parallel" if get("use_parallel_residual") else "pre_ln",
        ffn=ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """GPT-NeoX's keys; what it lacks (GQA, a window, bias-free layers...) shows in the
    round trip."""
    acts = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
    rope = dict(rope_to_hf(cfg), partial_rotary_factor=cfg.rope_fraction)
    return dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                hidden_act=acts.get(cfg.ffn, "gelu"), max_position_embeddings=cfg.max_seq_len,
                layer_norm_eps=cfg.norm_eps, use_parallel_residual=PARALLEL_RESIDUAL.get(cfg.block, False),
                attention_bias=True, rope_parameters=rope, attention_dropout=0.0,
                hidden_dropout=cfg.dropout, initializer_range=0.02,
                # transformers 4.x reads these instead of rope_parameters
                rotary_pct=cfg.rope_fraction, rotary_emb_base=cfg.rope_theta,
                rope_scaling=None if rope["rope_type"] == "default" else
                {k: v for k, v in rope.items() if k not in ("rope_theta",
                                                            "partial_rotary_factor")})


def _fused_qkv(block: str, name: str, cfg: ModelConfig, rope) -> Rule:
    """query_key_value's weight [3 N H, D] or bias [3 N H], its output axis [N, 3, H] (per
    head q, k, v), <-> query/key/value kernels [D, N, H] or biases [N, H]; `rope` permutes
    q and k for an interleaved checkpoint."""
    n, h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    weight = name.endswith(".weight")
    keep = (lambda x: x, lambda x: x)
    posts = (rope or keep, rope or keep, keep)

    def to_ours(w):
        w = w.T.reshape(d, n, 3, h) if weight else w.reshape(n, 3, h)
        return tuple(fwd(w[..., j, :]) for j, (fwd, _) in enumerate(posts))

    def to_hf(*qkv):
        w = np.stack([inv(x) for x, (_, inv) in zip(qkv, posts)], axis=-2)
        return (w.reshape(d, 3 * n * h).T,) if weight else (w.reshape(3 * n * h),)

    leaf = "kernel" if weight else "bias"
    return Rule(tuple((block, "attn", x, leaf) for x in ("query", "key", "value")), (name,),
                ((3 * n * h, d) if weight else (3 * n * h,),), to_ours, to_hf)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    d, n, h, f, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    rope = rope_permutation(rope_layout)
    t = row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embed_in.weight", (v, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += [_fused_qkv(b, f"{p}attention.query_key_value.{x}", cfg, rope)
                  for x in ("weight", "bias")]
        rules += [
            linear((b, "attn", "out", "kernel"), f"{p}attention.dense.weight", (d, n * h),
                   (n, h, d)),
            copied((b, "attn", "out", "bias"), f"{p}attention.dense.bias", (d,)),
            linear((b, "ffn", "wi", "kernel"), f"{p}mlp.dense_h_to_4h.weight", (f, d), (d, f)),
            copied((b, "ffn", "wi", "bias"), f"{p}mlp.dense_h_to_4h.bias", (f,)),
            linear((b, "ffn", "wo", "kernel"), f"{p}mlp.dense_4h_to_h.weight", (d, f), (f, d)),
            copied((b, "ffn", "wo", "bias"), f"{p}mlp.dense_4h_to_h.bias", (d,)),
        ]
        for ours, hf in (("attn_norm", "input_layernorm"),
                         ("ffn_norm", "post_attention_layernorm")):
            rules += [copied((b, ours, "scale"), f"{p}{hf}.weight", (d,)),
                      copied((b, ours, "bias"), f"{p}{hf}.bias", (d,))]
    rules += [copied(("final_norm", "scale"), f"{t}final_layer_norm.weight", (d,)),
              copied(("final_norm", "bias"), f"{t}final_layer_norm.bias", (d,))]
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules
