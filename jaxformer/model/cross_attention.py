"""Cross-attention: a decoder block's queries over the encoder's output (an
encoder-decoder, model.arch=encoder_decoder), its mask built from the source's padding and
segment ids, and its keys and values cached once per source for decoding.

No position scheme applies here (as in T5, BART and the original Transformer): queries
and keys are not rotated, no bias is added, and a target token of segment s sees every
source token of segment s (segment 0, padding, sees and is seen by nothing).
"""

from __future__ import annotations

import math

import flax.struct
import jax.numpy as jnp

from jaxformer.attention import kv_cache
from jaxformer.attention.backends import rule_attention
from jaxformer.attention.masks import MaskRule
from jaxformer.core.hooks import hook_point
from jaxformer.model.kinds import QK_NORMS
from jaxformer.model.norms import apply_norm
from jaxformer.model.self_attention import Attention


@flax.struct.dataclass
class Memory:
    """What the decoder reads of the encoder: its output states [B, S, D], the source's
    positions and segment ids [B, S] (0 = padding)."""

    states: jnp.ndarray
    positions: jnp.ndarray
    segment_ids: jnp.ndarray

    def rule(self, q_positions, q_segment_ids=None) -> MaskRule:
        """The cross-attention mask of queries at q_positions [B, T] with segment ids
        q_segment_ids [B, T] (None: all segment 1): same segment, no causal rule."""
        if q_segment_ids is None:
            q_segment_ids = jnp.ones(q_positions.shape, jnp.int32)
        return MaskRule(q_positions, self.positions, q_segment_ids, self.segment_ids,
                        causal=False)

    def repeat(self, n: int) -> "Memory":
        """Each row n times (beam search's beams share their row's source)."""
        return Memory(*(jnp.repeat(x, n, axis=0) for x in (self.states, self.positions,
                                                          self.segment_ids)))


class CrossAttention(Attention):
    """Attention's projections (query [D, N, H], key/value [D, K, H], out [N, H, D], the
    model's qk_norm, LoRA, attn_scale, soft-cap and sinks) with keys and values from the
    encoder's states; no rotation, no bias. The backend is the one the model chose."""

    def memory_kv(self, states):
        """Keys and values [B, S, K, H] of the encoder's states."""
        k, v = self.projection("key", states), self.projection("value", states)
        if QK_NORMS[self.cfg.qk_norm].key_axes is not None:
            k = apply_norm(self.cfg, self.k_norm, k)
        return hook_point(self, "hook_k", k), hook_point(self, "hook_v", v)

    def queries(self, x):
        """Queries [B, T, N, H] of the decoder's x, normed and scaled as self-attention's."""
        c = self.cfg
        q = hook_point(self, "hook_q", self.projection("query", x))
        if QK_NORMS[c.qk_norm].query_axes is not None:
            q = apply_norm(c, self.q_norm, q)
        if c.attn_scale is not None:  # the backends scale by 1 / sqrt(head_dim)
            q = q * jnp.asarray(c.attn_scale * math.sqrt(c.head_dim), q.dtype)
        return q

    def __call__(self, x, memory: Memory, rule: MaskRule, cache=None):
        """x [B, T, D] attending over memory.states -> [B, T, D]. With a layer cache
        (a dict; empty at the first call) the keys and values are computed the first time,
        kept in it as cross_k / cross_v [B * K, S, H] (the KV cache's row layout), and
        read afterwards: (output, cache)."""
        q = self.queries(x)
        if cache is None:
            k, v = self.memory_kv(memory.states)
            z = rule_attention(q, k, v, rule, None, impl=self.backend, **self.extras)
            return self.finish(hook_point(self, "hook_z", z))
        if "cross_k" not in cache:
            k, v = self.memory_kv(memory.states)
            b, s, n_kv, h = k.shape
            rows = lambda t: jnp.swapaxes(t, 1, 2).reshape(b * n_kv, s, h)  # noqa: E731
            cache = {"cross_k": rows(k), "cross_v": rows(v)}
        k, v = (cache[n].astype(q.dtype) for n in ("cross_k", "cross_v"))
        z = kv_cache.cached_attention(q, k, v, mask=rule.dense(), **self.extras)
        return self.finish(hook_point(self, "hook_z", z)), cache
