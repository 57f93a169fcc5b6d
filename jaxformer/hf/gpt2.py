"""GPT-2's own layout: its config.json keys and its tensors (Conv1D weights [in, out], q|k|v
fused in c_attn), both ways."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxformer.hf.rope import unsupported
from jaxformer.hf.tensors import Rule, copied, linear, reshaped
from jaxformer.model.config import ModelConfig

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
BUFFERS = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)  # older checkpoints' masks


def read_config(hf, get, row) -> ModelConfig:
    act = get("activation_function")
    if act not in ACTIVATIONS:
        raise unsupported("activation_function", act, "jaxformer's gelu is the tanh "
                          f"approximation; supported: {', '.join(ACTIVATIONS)}")
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
        ffn=ACTIVATIONS[act], use_bias=True, qkv_bias=True,
        tie_embeddings=bool(get("tie_word_embeddings")))


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """GPT-2's keys; what GPT-2 lacks (RMSNorm, GQA, a window...) shows in the round trip."""
    acts = {"gelu": "gelu_new", "relu": "relu"}
    return dict(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                n_positions=cfg.max_seq_len, activation_function=acts.get(cfg.ffn, "gelu_new"),
                layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attn_pdrop=0.0, initializer_range=0.02)


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    if rope_layout != "half":
        raise ValueError("rope_layout applies to RoPE models; GPT-2 has learned positions")
    d, n, h, f, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    t = row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}wte.weight", (v, d)),
             copied(("pos_embed", "embedding"), f"{t}wpe.weight", (cfg.max_seq_len, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}h.{i}."
        attn = [(b, "attn", x) for x in ("query", "key", "value")]
        rules += [
            copied((b, "attn_norm", "scale"), f"{p}ln_1.weight", (d,)),
            copied((b, "attn_norm", "bias"), f"{p}ln_1.bias", (d,)),
            Rule(tuple(a + ("kernel",) for a in attn), (f"{p}attn.c_attn.weight",), ((d, 3 * d),),
                 lambda w: tuple(x.reshape(d, n, h) for x in np.split(w, 3, axis=1)),
                 lambda *qkv: (np.concatenate([x.reshape(d, d) for x in qkv], axis=1),)),
            Rule(tuple(a + ("bias",) for a in attn), (f"{p}attn.c_attn.bias",), ((3 * d,),),
                 lambda w: tuple(x.reshape(n, h) for x in np.split(w, 3)),
                 lambda *qkv: (np.concatenate([x.reshape(d) for x in qkv]),)),
            reshaped((b, "attn", "out", "kernel"), f"{p}attn.c_proj.weight", (d, d), (n, h, d)),
            copied((b, "attn", "out", "bias"), f"{p}attn.c_proj.bias", (d,)),
            copied((b, "ffn_norm", "scale"), f"{p}ln_2.weight", (d,)),
            copied((b, "ffn_norm", "bias"), f"{p}ln_2.bias", (d,)),
            copied((b, "ffn", "wi", "kernel"), f"{p}mlp.c_fc.weight", (d, f)),
            copied((b, "ffn", "wi", "bias"), f"{p}mlp.c_fc.bias", (f,)),
            copied((b, "ffn", "wo", "kernel"), f"{p}mlp.c_proj.weight", (f, d)),
            copied((b, "ffn", "wo", "bias"), f"{p}mlp.c_proj.bias", (d,)),
        ]
    rules += [copied(("final_norm", "scale"), f"{t}ln_f.weight", (d,)),
              copied(("final_norm", "bias"), f"{t}ln_f.bias", (d,))]
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules
