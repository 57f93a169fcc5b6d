"""The MLAttention module: multi-head latent attention (jaxformer.attention.mla) as a Flax layer, the
Attention module with its own projections. Without a KV cache it runs the expanded form
through the model's backend like any layer (masks, packing, windows, context parallelism);
with one it caches the latent and the rotated key and attends in the absorbed form (a
decode step), or a long prefill over the cache's latents expanded (EXPANDED_PREFILL).

Params (model.mla's sizes, N heads): q_down [D, q_lora_rank], q_down_norm, q_up [q_lora_rank,
N, nope + rope] (or query [D, N, nope + rope] when q_lora_rank is 0); kv_down [D,
kv_lora_rank + rope], kv_norm [kv_lora_rank], key_up [kv_lora_rank, N, nope], value_up
[kv_lora_rank, N, v_head_dim], out [N, v_head_dim, D]; biases on q_down, kv_down and out
with use_bias. Hooks, named as TransformerLens 4's MLA bridge names them: hook_q_latent
[B, T, q_lora_rank] and hook_kv_latent [B, T, kv_lora_rank] (after their norms: what the
cache holds), hook_rot_q [B, T, N, rope] and hook_rot_k [B, T, 1, rope] (the rotated
slices; the key's is shared by the heads), and the expanded hook_q, hook_k, hook_v
(TransformerLens has these as [B, N, T, .], HF's layout).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.attention import kv_cache
from jaxformer.attention.masks import MaskRule
from jaxformer.attention.mla import MLAConfig, default_scale, latent_attention
from jaxformer.core.hooks import hook_point
from jaxformer.core.sharding import constrain, init_with_names
from jaxformer.model.lora import LoRA
from jaxformer.model.self_attention import Attention, dense_init, projection_layer
from jaxformer.positions.schemes import POSITION_SCHEMES, LogitBias, dense_bias

# a chunk of at least this many tokens attends over the cache's latents expanded; shorter
# ones (a decode step) in the absorbed form. bench/decode.py --mla measures both.
EXPANDED_PREFILL = 64


class MLAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2/V3); see the module docstring."""

    def setup(self):
        c, m = self.cfg, self.cfg.mla

        def dense(feats, name, names, bias=False, axis=(-1,), std=0.02):
            return projection_layer(c, feats, axis, name, names, bias, std)

        def norm(name):  # the latents' RMSNorm, whatever model.norm is
            return nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype,
                              scale_init=init_with_names(nn.initializers.ones, "latent"),
                              name=name)

        n, qk = c.n_heads, m.qk_head_dim
        if m.q_lora_rank:
            self.q_down = dense((m.q_lora_rank,), "q_down", ("embed", "latent"), c.use_bias)
            self.q_down_norm = norm("q_down_norm")
            self.q_up = dense((n, qk), "q_up", ("latent", "heads", "head_dim"))
        else:
            self.query = dense((n, qk), "query", ("embed", "heads", "head_dim"))
        self.kv_down = dense((m.kv_lora_rank + m.qk_rope_head_dim,), "kv_down",
                             ("embed", "latent"), c.use_bias)
        self.kv_norm = norm("kv_norm")
        self.key_up = self.param("key_up", init_with_names(dense_init(), "latent", "heads",
                                                           "head_dim"),
                                 (m.kv_lora_rank, n, m.qk_nope_head_dim), c.param_dtype)
        self.value_up = self.param("value_up", init_with_names(dense_init(), "latent", "heads",
                                                               "head_dim"),
                                   (m.kv_lora_rank, n, m.v_head_dim), c.param_dtype)
        out_names = ("heads", "head_dim", "embed")
        self.out = dense(c.d_model, "out", out_names, c.use_bias, axis=(-2, -1),
                         std=0.02 / math.sqrt(2 * c.n_layers))
        self.dropout = nn.Dropout(c.dropout)
        if "out" in c.lora.projections():
            self.out_lora = LoRA(c.lora, 2, (c.d_model,), out_names, c.dtype, c.param_dtype,
                                 self.deterministic)
        self.setup_sinks()

    def latents(self, x, positions, kind=0):
        """x [B, T, D] -> q_nope [B, T, N, nope], q_rope [B, T, N, rope] (rotated), the
        latent [B, T, kv_lora_rank] (normed) and the rope key [B, T, 1, rope] (rotated);
        the query scaled by attn_scale as Attention's."""
        c, m = self.cfg, self.cfg.mla
        if m.q_lora_rank:
            q = self.q_up(hook_point(self, "hook_q_latent", self.q_down_norm(self.q_down(x))))
        else:
            q = self.query(x)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        compressed = self.kv_down(x)
        latent = hook_point(self, "hook_kv_latent",
                            self.kv_norm(compressed[..., :m.kv_lora_rank]))
        k_rope = compressed[..., m.kv_lora_rank:][:, :, None, :]
        rotate = POSITION_SCHEMES[c.position].rotate
        if rotate is not None:  # on the decoupled slice alone: its own head_dim
            rc = c.replace(head_dim=m.qk_rope_head_dim, mla=MLAConfig())
            q_rope = rotate(rc, q_rope, positions, kind, keys=False)
            k_rope = rotate(rc, k_rope, positions, kind, keys=True)
        q_rope = hook_point(self, "hook_rot_q", q_rope)
        k_rope = hook_point(self, "hook_rot_k", k_rope)
        if c.attn_scale is not None:  # latent_attention and the backends scale by default_scale
            factor = jnp.asarray(c.attn_scale / default_scale(m), q.dtype)
            q_nope, q_rope = q_nope * factor, q_rope * factor
        return q_nope, q_rope, latent, k_rope

    def project(self, x, positions, kind=0):
        """The expanded form: q, k [B, T, N, nope + rope] and v [B, T, N, v_head_dim]."""
        q_nope, q_rope, latent, k_rope = self.latents(x, positions, kind)
        k_nope = jnp.einsum("btr,rnd->btnd", latent, self.key_up.astype(latent.dtype))
        v = jnp.einsum("btr,rnd->btnd", latent, self.value_up.astype(latent.dtype))
        k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))
        q = hook_point(self, "hook_q", jnp.concatenate([q_nope, q_rope], axis=-1))
        k = hook_point(self, "hook_k", jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], -1))
        v = hook_point(self, "hook_v", v)
        q = constrain(q, "act_batch", "act_seq", "act_heads", "head_dim")
        k = constrain(k, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        v = constrain(v, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        return q, k, v

    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None, kind=0):
        """Without a cache: Attention's (the expanded form). With one: the latent and the
        rope key written to it (its k and v), then the absorbed form over its slots."""
        if cache is None:
            return super().__call__(x, positions, mask, bias, cache, cache_index, kind)
        q_nope, q_rope, latent, k_rope = self.latents(x, positions, kind)
        rope_key, cached, mask, cache = self.cached_keys(k_rope, latent[:, :, None], mask,
                                                         cache, cache_index)
        if isinstance(bias, LogitBias):
            bias = dense_bias(bias, mask.q_positions, mask.k_positions)
        mask = mask.dense() if isinstance(mask, MaskRule) else mask
        cached, rope_key = cached.astype(q_nope.dtype), rope_key.astype(q_nope.dtype)
        if x.shape[1] >= EXPANDED_PREFILL:  # a prefill: the cache's latents expanded
            z = self.expanded_over_cache(q_nope, q_rope, cached, rope_key, mask, bias)
        else:
            q_latent = jnp.einsum("btnd,rnd->btnr", q_nope, self.key_up.astype(q_nope.dtype))
            z = latent_attention(q_latent, q_rope, cached, rope_key, mask=mask, bias=bias,
                                 scale=default_scale(self.cfg.mla), **self.extras)
            z = jnp.einsum("btnr,rnd->btnd", z, self.value_up.astype(z.dtype))
        return self.finish(hook_point(self, "hook_z", z)), cache

    def expanded_over_cache(self, q_nope, q_rope, latent, rope_key, mask, bias):
        """Attention over the cache's slots with their keys and values expanded from the
        latents (latent [B, S, R], rope_key [B, S, P]) -> z [B, T, N, v_head_dim]."""
        b, s, _ = latent.shape
        n = self.cfg.n_heads
        k_nope = jnp.einsum("bsr,rnd->bnsd", latent, self.key_up.astype(latent.dtype))
        k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key[:, None], (b, n, s,
                                                                         rope_key.shape[-1]))], -1)
        v = jnp.einsum("bsr,rnd->bnsd", latent, self.value_up.astype(latent.dtype))
        q = jnp.concatenate([q_nope, q_rope], -1)
        return kv_cache.cached_attention(q, k.reshape(b * n, s, -1), v.reshape(b * n, s, -1),
                                         mask=mask, bias=bias, **self.extras)
