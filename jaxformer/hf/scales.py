"""Fields of a Llama-layout family beyond the layout (its row's extra and extra_to_hf,
jaxformer.hf.families): Gemma's embedding scale, query scale and soft-caps, Granite's
multipliers. Each reader takes get (a config.json key or its default) and returns
ModelConfig fields; each writer returns config.json keys."""

from __future__ import annotations

import math

from jaxformer.hf.llama_layout import head_dim
from jaxformer.hf.rope import cannot


def gemma(get) -> dict:
    d = get("hidden_size")
    scalar = get("query_pre_attn_scalar")
    return dict(embed_multiplier=math.sqrt(d),
                attn_scale=None if scalar is None or scalar == head_dim(get) else scalar ** -0.5)


def gemma_to_hf(cfg) -> dict:  # embeddings times sqrt(d_model): checked by the round trip
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale ** -2
    if not math.isclose(scalar, round(scalar), rel_tol=1e-9):
        raise cannot("attn_scale", cfg.attn_scale, "Gemma's query_pre_attn_scalar (the scale "
                     "is its -1/2 power) is an integer")
    return dict(query_pre_attn_scalar=round(scalar))


def gemma2(get) -> dict:
    return dict(gemma(get), attn_softcap=get("attn_logit_softcapping"),
                final_softcap=get("final_logit_softcapping"))


def gemma2_to_hf(cfg) -> dict:
    return dict(gemma_to_hf(cfg), attn_logit_softcapping=cfg.attn_softcap,
                final_logit_softcapping=cfg.final_softcap)


def gemma3(get) -> dict:
    # Gemma3's attention never applies attn_logit_softcapping (the key is read and unused)
    return dict(gemma(get), final_softcap=get("final_logit_softcapping"))


def gemma3_to_hf(cfg) -> dict:
    return dict(gemma_to_hf(cfg), final_logit_softcapping=cfg.final_softcap,
                attn_logit_softcapping=None)


def granite(get) -> dict:
    return dict(embed_multiplier=float(get("embedding_multiplier")),
                residual_multiplier=float(get("residual_multiplier")),
                attn_scale=float(get("attention_multiplier")),
                logits_multiplier=1.0 / float(get("logits_scaling")))


def granite_to_hf(cfg) -> dict:
    return dict(embedding_multiplier=cfg.embed_multiplier,
                residual_multiplier=cfg.residual_multiplier,
                attention_multiplier=cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim),
                logits_scaling=1.0 / cfg.logits_multiplier)
