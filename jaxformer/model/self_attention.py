"""The Attention module: projections, the position scheme's rotation, and the backend the
model chose for this forward (jaxformer.attention.backends), over the sequence or a KV cache.

The attention functions themselves live in jaxformer.attention (the backends' table, the
kernels, masks and the KV cache) and jaxformer.core.reference (the definition).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import kv_cache, paged_cache
from jaxformer.attention.backends import (dot_product_attention, prefill_impl,  # noqa: F401
                                          resolve_impl, rule_attention, takes_structure)
from jaxformer.attention.masks import (MaskRule, causal_mask, make_attention_mask,  # noqa: F401
                                       padding_mask, segment_mask, sliding_window_mask)
from jaxformer.core.hooks import active, hook_point
from jaxformer.core.matmul import projection_dot, promote_kernel
from jaxformer.core.reference import (and_causal, as_4d, attention_weights,  # noqa: F401
                                      group_heads, grouped_logits, mix, softmax)
from jaxformer.core.sharding import constrain, init_with_names
from jaxformer.model.config import ModelConfig
from jaxformer.model.kinds import QK_NORMS
from jaxformer.model.lora import LoRA
from jaxformer.model.norms import apply_norm, make_norm, rms_normalize
from jaxformer.positions.schemes import POSITION_SCHEMES, LogitBias, dense_bias


def dense_init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


def projection_layer(c: ModelConfig, feats, axis, name: str, names, bias: bool,
                     std: float = 0.02) -> nn.DenseGeneral:
    """An attention projection: a DenseGeneral over `axis` to `feats`, its kernel's logical
    axes `names` (the bias's the output ones), as 2-D dots in the model's dtypes."""
    return nn.DenseGeneral(
        feats, axis=axis, use_bias=bias, dtype=c.dtype, param_dtype=c.param_dtype,
        kernel_init=init_with_names(dense_init(std), *names),
        bias_init=init_with_names(nn.initializers.zeros, *names[len(axis):]),
        dot_general=projection_dot(c.matmul_precision), promote_dtype=promote_kernel,
        name=name)


def query_temperature(positions, floor, scale):
    """Llama 4's attention temperature tuning: 1 + scale * log(1 + floor((p + 1) / floor))
    at positions p [B, T] -> [B, T] float32 (floor, scale: numbers or traced scalars)."""
    p = positions.astype(jnp.float32)
    return 1.0 + scale * jnp.log1p(jnp.floor((p + 1.0) / floor))


def tuned_queries(cfg: ModelConfig, q, positions, kind):
    """q [B, T, N, H] times its temperature where layer kind `kind` tunes it (LayerKind's
    temperature_floor and temperature_scale; kind traced in a scan), else q."""
    floors = [k.temperature_floor for k in cfg.kinds]
    if all(f is None for f in floors):
        return q
    scales = [0.0 if f is None else k.temperature_scale for f, k in zip(floors, cfg.kinds)]
    floors = [f or 1 for f in floors]
    if isinstance(kind, int):
        if scales[kind] == 0.0:
            return q
        floor, scale = floors[kind], scales[kind]
    else:
        floor = jnp.asarray(floors, jnp.float32)[kind]
        scale = jnp.asarray(scales, jnp.float32)[kind]
    t = query_temperature(positions, floor, scale)  # [B, T]
    return (q * t[:, :, None, None]).astype(q.dtype)


class Attention(nn.Module):
    """Multi-head (GQA/MQA) self-attention; queries and keys rotated when the position
    scheme rotates them.

    Params: query [D, N, H], key/value [D, K, H], out [N, H, D]; biases on q/k/v if
    qkv_bias, on out if use_bias; q_norm/k_norm scales [H] (qk_norm head) or [N|K, H]
    (projection); sinks [N] if attn_sinks (a logit per head in every row's softmax,
    gpt-oss); gate [D, N, H] (its bias [N, H] with the query's) if attn_output_gate: each
    head's output times sigmoid(gate x) before the output projection (Qwen3-Next, Qwen3.5).
    impl: the backend chosen for this forward (the model resolves `auto` once and hands it
    down); None reads cfg.attention_impl.
    """

    cfg: ModelConfig
    deterministic: bool = True
    impl: str | None = None

    def setup(self):
        c = self.cfg
        dense = functools.partial(projection_layer, c)
        q_names, kv_names = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.query = dense((c.n_heads, c.head_dim), (-1,), "query", q_names, c.qkv_bias)
        self.key = dense((c.n_kv_heads, c.head_dim), (-1,), "key", kv_names, c.qkv_bias)
        self.value = dense((c.n_kv_heads, c.head_dim), (-1,), "value", kv_names, c.qkv_bias)
        if c.attn_output_gate:  # per head, beside the query (a bias where it has one)
            self.gate = dense((c.n_heads, c.head_dim), (-1,), "gate", q_names, c.qkv_bias)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers)
        self.out = dense(c.d_model, (-2, -1), "out", ("heads", "head_dim", "embed"), c.use_bias,
                         0.02 / math.sqrt(2 * c.n_layers))
        self.dropout = nn.Dropout(c.dropout)
        for name, (in_axes, names) in {"query": (1, q_names), "key": (1, kv_names),
                                       "value": (1, kv_names),
                                       "out": (2, ("heads", "head_dim", "embed"))}.items():
            if name in c.lora.projections():  # LoRA: attn/{name}_lora/{lora_a, lora_b}
                shape = dict(query=(c.n_heads, c.head_dim), out=(c.d_model,)).get(
                    name, (c.n_kv_heads, c.head_dim))
                setattr(self, f"{name}_lora", LoRA(c.lora, in_axes, shape, names, c.dtype,
                                                   c.param_dtype, self.deterministic))
        scheme = POSITION_SCHEMES[c.position]
        if scheme.logits is not None:  # a contextual scheme: this layer's own logits (CoPE)
            self.context_logits = scheme.logits(self, c)
        qk_norm = QK_NORMS[c.qk_norm]  # over head_dim per head, or the whole projection
        if qk_norm.query_axes is not None and qk_norm.scale:
            self.q_norm = make_norm(c, "q_norm", qk_norm.query_axes)
            self.k_norm = make_norm(c, "k_norm", qk_norm.key_axes)
        self.setup_sinks()

    def setup_sinks(self):
        """The attention sinks' param [N] when the model has them (setup's last step)."""
        if self.cfg.attn_sinks:
            self.sinks = self.param("sinks", init_with_names(dense_init(), "heads"),
                                    (self.cfg.n_heads,), self.cfg.param_dtype)

    @property
    def backend(self) -> str:
        return self.impl or self.cfg.attention_impl

    @property
    def cap(self) -> dict:
        """The logits' soft-cap as the backends take it (nothing when there is none)."""
        return {} if self.cfg.attn_softcap is None else {"softcap": self.cfg.attn_softcap}

    @property
    def extras(self) -> dict:
        """The soft-cap and the attention sinks as the backends take them (those there are)."""
        return dict(self.cap, **({"sinks": self.sinks} if self.cfg.attn_sinks else {}))

    def project(self, x, positions, kind=0):
        """x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H]: QK-normed if qk_norm, rotated
        as layer kind `kind` wants if the scheme rotates (the QK-norm before the rotation,
        or after it where the QK_NORMS row says), q scaled by attn_scale."""
        c = self.cfg
        q, k, v = (hook_point(self, f"hook_{n}", self.projection(name, x))
                   for n, name in (("q", "query"), ("k", "key"), ("v", "value")))
        qk_norm = QK_NORMS[c.qk_norm]
        if qk_norm.query_axes is not None and not qk_norm.after_rope:
            q, k = self.qk_normed(q, k, kind)
        rotate = POSITION_SCHEMES[c.position].rotate
        if rotate is not None:
            q = hook_point(self, "hook_rot_q", rotate(c, q, positions, kind, keys=False))
            k = hook_point(self, "hook_rot_k", rotate(c, k, positions, kind, keys=True))
        if qk_norm.query_axes is not None and qk_norm.after_rope:  # Hunyuan's order
            q, k = self.qk_normed(q, k, kind)
        q = tuned_queries(c, q, positions, kind)
        if c.attn_scale is not None:  # the backends scale by 1 / sqrt(head_dim)
            q = q * jnp.asarray(c.attn_scale * math.sqrt(c.head_dim), q.dtype)
        q = constrain(q, "act_batch", "act_seq", "act_heads", "head_dim")
        k = constrain(k, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        v = constrain(v, "act_batch", "act_seq", "act_kv_heads", "head_dim")
        return q, k, v

    def qk_normed(self, q, k, kind):
        """q [B, T, N, H], k [B, T, K, H] QK-normed (with the norms' weights, or x / rms(x)
        where the QK_NORMS row has none), unless layer kind `kind` skips its QK-norm."""
        c, row = self.cfg, QK_NORMS[self.cfg.qk_norm]
        if row.scale:
            normed = apply_norm(c, self.q_norm, q), apply_norm(c, self.k_norm, k)
        else:
            axes = tuple(range(-len(row.query_axes), 0))
            normed = tuple(rms_normalize(x, c.norm_eps, axes).astype(x.dtype) for x in (q, k))
        keep = [kd.qk_norm for kd in c.kinds]
        if all(keep):
            return normed
        on = keep[kind] if isinstance(kind, int) else jnp.asarray(keep)[kind]
        return tuple(jnp.where(on, y, x) for y, x in zip(normed, (q, k)))

    def projection(self, name, x):
        """Projection `name` of x, plus its LoRA update when the model has one."""
        y = getattr(self, name)(x)
        if name not in self.cfg.lora.projections():
            return y
        return y + getattr(self, f"{name}_lora")(x)

    @property
    def contextual(self) -> bool:
        return POSITION_SCHEMES[self.cfg.position].logits is not None

    def attend_with_pattern(self, q, k, v, mask, bias, is_causal=True):
        """The reference attention with hook points on the scores (scaled, biased, -inf where
        masked) and the pattern [B, N, Tq, Tk]: for jaxformer.model.inspect, when asked for, and
        for a contextual scheme (its own logits). mask: a bool array; is_causal: also hide
        keys after each query's index (self-attention)."""
        mask = and_causal(as_4d(mask), q.shape[1]) if is_causal else as_4d(mask)
        if self.contextual:
            logits = self.context_logits(q, k, mask)  # [B, K, G, T, S]
        else:
            logits = grouped_logits(q, k, mask=mask, bias=as_4d(bias), scale=None, **self.cap)
        scores = hook_point(self, "hook_attn_scores",
                            logits.reshape(q.shape[0], -1, *logits.shape[3:]))  # [B, N, T, S]
        sinks = self.sinks.reshape(1, -1, 1, 1) if self.cfg.attn_sinks else None
        pattern = hook_point(self, "hook_pattern", softmax(scores, sinks))
        return mix(group_heads(pattern, k.shape[2]), v, q)  # [B, T, N, H]

    def finish(self, z):
        """Heads [B, T, N, H] -> output projection (+ dropout) [B, T, D]."""
        return self.dropout(self.projection("out", z), deterministic=self.deterministic)

    def gated(self, z, x):
        """The heads' outputs z [B, T, N, H] times sigmoid(gate x) where attn_output_gate
        (hook_gate: the sigmoid), else z."""
        if not self.cfg.attn_output_gate:
            return z
        gate = hook_point(self, "hook_gate", jax.nn.sigmoid(self.gate(x)))  # [B, T, N, H]
        return z * gate.astype(z.dtype)

    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None, kind=0):
        """Without a cache: attention within x. With a layer's KV cache (jaxformer.attention.kv_cache)
        the new keys/values are written at slots [cache_index, cache_index + T), attention
        runs over all its slots (the mask hides slots not written or not valid), and the
        updated layer cache is returned beside the output.

        mask: a MaskRule (the model's) or a bool array; bias: a LogitBias where
        takes_structure says, else an array or None. kind: the layer's kind (cfg.kinds)."""
        q, k, v = self.project(x, positions, kind)
        if cache is None:
            z = self.gated(self.attend(q, k, v, mask, bias), x)
            return self.finish(hook_point(self, "hook_z", z))
        if self.contextual and "positions" in cache:
            raise ValueError(f"position={self.cfg.position!r} counts keys in row order, which a "
                             "windowed layer's ring cache does not keep; use "
                             "init_cache(..., windowed=False)")
        if kv_cache.reads_pairs(cache):  # a paged decode step: each row's own pages
            return self.pair_step(q, k, v, x, mask, bias, cache)
        k, v, mask, cache = self.cached_keys(k, v, mask, cache, cache_index)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        if self.contextual:  # over the cache's slots (in row order: CoPE has no ring)
            z = self.attend_with_pattern(q, kv_cache.as_keys(k, q.shape[0]),
                                         kv_cache.as_keys(v, q.shape[0]), mask.dense(), None,
                                         is_causal=False)
        elif takes_structure(self.backend, q.shape[1], cached=True):  # a prefill, by blocks
            z = rule_attention(q, kv_cache.as_keys(k, q.shape[0]), kv_cache.as_keys(v, q.shape[0]),
                               mask, bias, impl=prefill_impl(self.backend), **self.extras)
        else:
            if isinstance(bias, LogitBias):  # left as structure for a ring's own positions
                bias = dense_bias(bias, mask.q_positions, mask.k_positions)
            z = kv_cache.cached_attention(q, k, v, bias=bias, mask=mask.dense()
                                          if isinstance(mask, MaskRule) else mask, **self.extras)
        return self.finish(hook_point(self, "hook_z", self.gated(z, x))), cache

    def pair_step(self, q, k, v, x, rule: MaskRule, bias, cache):
        """A paged decode step read by (row, page) pairs (paged_cache.pair_attention): the
        new k, v written to the pages, the output [B, 1, D] and the layer's cache."""
        cache = paged_cache.write_pages(cache, k, v)
        rule = paged_cache.pair_rule(rule, cache)
        if isinstance(bias, LogitBias):
            bias = dense_bias(bias, rule.q_positions, rule.k_positions)
        z = paged_cache.pair_attention(q, cache, rule.dense(), bias, **self.extras)
        return self.finish(hook_point(self, "hook_z", self.gated(z, x))), cache

    @staticmethod
    def cached_keys(k, v, rule: MaskRule, cache, cache_index):
        """The new k, v [B, T, K, H] written into a layer's cache; the keys and values
        [B * K, S', H] to attend over, the rule with their positions, and the cache.
        A full-length layer's keys are its slots. A ring (a windowed layer) is written by
        position; a single token then attends over the ring, a chunk over the ring as it
        was followed by the chunk itself."""
        if paged_cache.is_paged(cache):  # a pool of pages, read through the rows' tables
            keys, values, cache = paged_cache.paged_keys(cache, k, v)
            return keys, values, rule, cache
        if "positions" not in cache:
            cache = kv_cache.write_layer(cache, k, v, cache_index)
            return cache["k"], cache["v"], rule, cache
        new = jax.lax.dynamic_slice_in_dim(rule.k_positions, cache_index, k.shape[1], axis=1)
        if k.shape[1] == 1:
            cache = kv_cache.write_ring(cache, k, v, new)
            keys, values, k_positions = cache["k"], cache["v"], cache["positions"]
        else:
            keys, values, k_positions = kv_cache.ring_keys(cache, k, v, new)
            cache = kv_cache.write_ring(cache, k, v, new)
        return keys, values, rule.replace(k_positions=k_positions), cache

    def attend(self, q, k, v, mask, bias):
        """Attention within the sequence: the hooked reference when inspection asks for
        scores or patterns (the whole grid, for this layer) or the scheme computes the
        logits itself (the model chose `reference` for it), else the chosen backend."""
        if active(self, "hook_attn_scores", "hook_pattern") or self.contextual:
            if isinstance(mask, MaskRule):  # its dense mask holds is_causal already
                if isinstance(bias, LogitBias):
                    bias = dense_bias(bias, mask.q_positions, mask.k_positions)
                return self.attend_with_pattern(q, k, v, mask.dense(), bias, is_causal=False)
            return self.attend_with_pattern(q, k, v, mask, bias)
        if isinstance(mask, MaskRule):
            return rule_attention(q, k, v, mask, bias, impl=self.backend, **self.extras)
        return dot_product_attention(q, k, v, mask=mask, bias=bias, impl=self.backend,
                                     is_causal=True, **self.extras)
