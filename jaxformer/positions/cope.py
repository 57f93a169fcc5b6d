"""Contextual position encoding (CoPE, Golovneva et al. 2024): a key's position is counted
in the context, as the sum of gates sigmoid(q_i . k_m) over the keys m from it to the query,
and the logit gains q_i . e(p_ij), e interpolated between learned embeddings at integers.

    s_ij  = q_i . k_j
    g_im  = sigmoid(s_im / sqrt(head_dim)) on keys query i may attend to, 0 elsewhere
    p_ij  = min(sum_{m >= j} g_im, P - 1)  (P = model.position_settings.positions, the
            paper's npos_max)
    e(p)  = (ceil p - p) e[floor p] + (p - floor p) e[ceil p]   (e[ceil] where p is whole)
    a_ij  = (s_ij + q_i . e(p_ij)) / sqrt(head_dim),  -inf where masked

as the reference code computes it (facebookresearch/RAM, projects/cope: gates from the
scaled, masked logits; the sum from the key to the end of the row; the scale applied to
the sum of both terms). p_ij depends
on every gate of query i's row, so CoPE runs over whole rows of keys: the `reference`
backend (jaxformer.attention.backends), not blockwise attention. The scheme's entry
(position cope, its settings CopeSettings) is at the end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.core.reference import HIGHEST, group_heads, query_groups
from jaxformer.core.sharding import init_with_names
from jaxformer.core.validation import ConfigError, check_number
from jaxformer.positions.scheme import OWNER, PositionScheme, PositionSettings


def cope_logits(q, k, embedding, mask, *, scale=None):
    """CoPE's attention logits: float32 [B, K, G, Tq, Tk], -inf where masked.

    q: [B, Tq, N, H]; k: [B, Tk, K, H] (GQA: N a multiple of K); embedding: [H, P], the
    position embeddings e[0..P-1] as columns; mask: bool [B|1, 1|N, Tq, Tk], keys in row
    order (each query's keys before it are those up to it in the row); scale: None for
    1 / sqrt(H)."""
    b, t, n, h = q.shape
    n_kv, p_max = k.shape[2], embedding.shape[-1]
    qg = q.reshape(b, t, n_kv, query_groups(n, n_kv), h)  # [B, T, K, G, H]
    raw = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=HIGHEST,
                     preferred_element_type=jnp.float32)  # [B, K, G, T, S]
    allowed, scale = group_heads(mask, n_kv), jnp.float32(1.0 / math.sqrt(h) if scale is None
                                                          else scale)
    gates = jnp.where(allowed, jax.nn.sigmoid(raw * scale), 0.0)
    pos = jnp.minimum(jax.lax.cumsum(gates, axis=4, reverse=True), p_max - 1)  # p_ij
    at = jnp.einsum("btkgh,hp->bkgtp", qg, embedding.astype(q.dtype), precision=HIGHEST,
                    preferred_element_type=jnp.float32)  # q_i . e[p], [B, K, G, T, P]
    floor = jnp.floor(pos)
    low = jnp.take_along_axis(at, floor.astype(jnp.int32), axis=4)
    high = jnp.take_along_axis(at, jnp.ceil(pos).astype(jnp.int32), axis=4)
    w = pos - floor
    logits = (raw + high * w + low * (1.0 - w)) * scale
    return jnp.where(allowed, logits, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class CopeSettings(PositionSettings):
    """positions: CoPE's number of position embeddings (npos_max); a key's counted
    position is clamped to positions - 1."""

    positions: int = 64

    LEGACY: ClassVar = {"cope_positions": "positions"}

    def __post_init__(self):
        check_number(OWNER, "positions", self.positions, int, low=2)


def _cope(module, cfg):
    """CoPE's position embeddings [head_dim, positions] for one layer, shared by its heads
    (the reference code's shape). Initialised N(0, 0.02), where the reference starts at
    zeros (a NoPE model until trained): so a fresh model already counts positions."""
    table = module.param("cope_embedding", init_with_names(nn.initializers.normal(0.02),
                                                           "head_dim", "table"),
                         (cfg.head_dim, cfg.position_settings.positions), cfg.param_dtype)
    return lambda q, k, mask: cope_logits(q, k, table, mask)


def _check_cope(cfg):
    if cfg.attn_softcap is not None:
        raise ConfigError(f"position={cfg.position!r} with model.attn_softcap={cfg.attn_softcap}: "
                          "CoPE's gates read the raw logits, a cap has no defined place; "
                          "drop one of them")


SCHEMES = (PositionScheme("cope", "contextual", logits=_cope, check=_check_cope,
                          settings=CopeSettings, causal_only=True),)
