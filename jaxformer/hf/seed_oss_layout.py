"""Seed-OSS (seed_oss): the Llama layout with its own bias keys, and its row
(jaxformer.hf.model_type.HFModelType).

Seed-OSS is Llama's computation (pre-LN RMSNorm blocks, SwiGLU, GQA, RoPE, head_dim of
its own) with three bias keys: attention_bias on q, k and v (model.qkv_bias),
attention_out_bias on o and mlp_bias on the MLP, which jaxformer's use_bias sets together
(another pair is refused). attention_dropout (on the attention weights) and
residual_dropout (on each sublayer's output) act in training alone: they are not read
(model.dropout is the run's), and written as 0 and model.dropout. Its released models
(q, k, v biased alone) compute as Qwen2, the others with biases everywhere or nowhere as
Llama: to_hf writes them so unless asked for model_type="seed_oss"; with biases on o and
the MLP but not q, k, v, only seed_oss writes the model.
"""

from __future__ import annotations

from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.rope import unsupported


def _biases(get) -> dict[str, bool]:
    """qkv_bias from attention_bias; use_bias from attention_out_bias and mlp_bias, which
    must agree."""
    out, mlp = bool(get("attention_out_bias")), bool(get("mlp_bias"))
    if out != mlp:
        raise unsupported("attention_out_bias", out, f"beside mlp_bias={mlp}: jaxformer's "
                          "use_bias puts biases on o and the MLP together (seed_oss)")
    return dict(use_bias=out, qkv_bias=bool(get("attention_bias")))


def _biases_to_hf(cfg) -> dict:
    return dict(attention_bias=cfg.qkv_bias, attention_out_bias=cfg.use_bias,
                mlp_bias=cfg.use_bias, attention_dropout=0.0, residual_dropout=cfg.dropout)


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        "seed_oss", ("SeedOssForCausalLM", "SeedOssModel"), export_rank=54,
        defaults=dict(num_key_value_heads=8, hidden_act="silu", max_position_embeddings=524288,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
                      attention_out_bias=False, mlp_bias=False, head_dim=128,
                      rope_theta=10000.0),
        biases="none", extra=_biases, extra_to_hf=_biases_to_hf),
]
