"""Feed-forward networks (dense, and the mixture of experts: jaxformer.moe.experts) and the
transformer Block: how attention and the feed-forward network meet the residual (the
flows: jaxformer.model.kinds.BLOCKS)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention.masks import pick_rule
from jaxformer.core.hooks import active, hook_point
from jaxformer.core.matmul import projection_dot, promote_kernel
from jaxformer.core.sharding import constrain, init_with_names
from jaxformer.model.config import ModelConfig
from jaxformer.model.cross_attention import CrossAttention
from jaxformer.model.kinds import BLOCKS, FFNS
from jaxformer.model.latent_attention import MLAttention
from jaxformer.model.lora import adapted
from jaxformer.model.mixers import ATTENTION, MIXERS
from jaxformer.model.norms import apply_norm, make_norm, normalize  # noqa: F401
from jaxformer.model.self_attention import Attention, dense_init
from jaxformer.moe.expert_parallel import dispatch_for
from jaxformer.moe.experts import balance_losses, dense_weights, dispatch_of, expert_load, route


def scaled(x, multiplier):
    """x times a multiplier (a float or a traced scalar: a scanned layer's) in its dtype;
    x itself for None."""
    return x if multiplier is None else x * jnp.asarray(multiplier, x.dtype)


def kind_multiplier(cfg: ModelConfig, kind, name: str):
    """Layer kind `kind`'s multiplier `name` (jaxformer.model.layer_pattern.MULTIPLIERS):
    a float, or a traced scalar where the kind is (scanned); None where every kind's is 1."""
    values = [getattr(k, name) for k in cfg.kinds]
    if all(v == 1.0 for v in values):
        return None
    if isinstance(kind, int):
        return values[kind]
    return jnp.asarray(values, jnp.float32)[kind]


def scaled_inputs(x, weights, experts):
    """Routing that scales the experts' inputs (jaxformer.moe.experts.Router.scales_input):
    each of a token's k assignments a row of its own, the token times its weight, reaching
    its one expert with weight 1 (any dispatch runs them; the caller sums each token's k
    rows). x [N, D], weights, experts [N, k] -> rows [N k, D], weights, experts [N k, 1]."""
    n, k = experts.shape
    rows = (x[:, None, :] * weights[..., None].astype(x.dtype)).reshape(n * k, -1)  # [N k, D]
    return rows, jnp.ones((n * k, 1), weights.dtype), experts.reshape(n * k, 1)


class FeedForward(nn.Module):
    """gelu/relu: wo(act(wi x)). swiglu/geglu: wo(act(wi_gate x) * wi_up x).
    gate_multiplier: what the activation reads scaled first (None: not; Falcon-H1's)."""

    cfg: ModelConfig
    deterministic: bool = True
    gate_multiplier: Any = None

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        c = self.cfg
        def dense(x, feats, name, names, std=0.02):  # names: the kernel's logical axes
            y = nn.Dense(feats, use_bias=c.use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                         kernel_init=init_with_names(dense_init(std), *names),
                         bias_init=init_with_names(nn.initializers.zeros, names[1]),
                         dot_general=projection_dot(c.matmul_precision),
                         promote_dtype=promote_kernel,
                         name=name)(x)
            return adapted(self, c.lora, name, y, x, 1, names, c.dtype, c.param_dtype,
                           self.deterministic)

        ffn, up = FFNS[c.ffn], ("embed", "mlp")
        pre = scaled(dense(x, c.d_ff, "wi_gate" if c.gated_ffn else "wi", up),
                     self.gate_multiplier)
        pre = hook_point(self, "hook_pre", pre)
        if c.gated_ffn:  # [B, T, F]
            h = ffn.join(pre, hook_point(self, "hook_pre_linear", dense(x, c.d_ff, "wi_up", up)))
        else:
            h = ffn.activation(pre, **self.scalars(ffn, pre.dtype))
        h = hook_point(self, "hook_post", constrain(h, "act_batch", "act_seq", "act_mlp"))
        out = dense(h, c.d_model, "wo", ("mlp", "embed"), 0.02 / math.sqrt(2 * c.n_layers))
        return nn.Dropout(c.dropout)(out, deterministic=self.deterministic)

    def scalars(self, ffn, dtype) -> dict:
        """The activation's learned scalars (params [] each, FFN.scalars), its fixed ones
        outside the gradient, in `dtype`."""
        out = {}
        for name, value in ffn.scalars.items():
            w = self.param(name, init_with_names(nn.initializers.constant(value)), (),
                           self.cfg.param_dtype)
            out[name] = (jax.lax.stop_gradient(w) if name in ffn.fixed else w).astype(dtype)
        return out


class MoEFeedForward(nn.Module):
    """The mixture of experts of cfg.moe (jaxformer.moe.experts): a router [D, E] (float32 logits),
    routed experts' kernels [E, D, F] / [E, F, D] run by the config's dispatch, and the
    shared experts (a FeedForward of width shared_d_ff, sigmoid-gated where shared_gate).

    With the "moe" collection mutable it sows each forward's statistics there: load
    (assignments per expert [E]), aux and z (the balancing losses), dropped (the share of
    assignments over capacity). Hooks, named as TransformerLens 4 names a sparse block's:
    gate.hook_out (the router's logits [B, T, E]; TransformerLens calls the router gate),
    hook_expert_indices [B, T, k] (the chosen experts) and hook_expert_weights [B, T, E]
    (every expert's weight, 0 where not chosen, as TransformerLens's; a hook changes the
    chosen experts' weights: setting one expert's column to 0 removes it, and a weight
    given to an expert not chosen is not read)."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        c, m = self.cfg, self.cfg.moe
        if FFNS[c.ffn].scalars:
            raise ValueError(f"model.ffn={c.ffn} learns scalars per layer, which only a dense "
                             "FFN holds; the experts (model.moe) take another ffn")
        b, t, d = x.shape
        h = x.reshape(b * t, d)  # [N, D]
        router = nn.Dense(m.experts, use_bias=m.bias, dtype=jnp.float32,
                          param_dtype=c.param_dtype, name="router",
                          kernel_init=init_with_names(dense_init(), "embed", "experts"),
                          bias_init=init_with_names(nn.initializers.zeros, "experts"))
        logits = hook_point(self, "gate.hook_out",
                            router(h.astype(jnp.float32)).reshape(b, t, -1)).reshape(b * t, -1)
        score_bias = None
        if m.has_score_bias:  # moved by balancing outside the gradient, never by it
            score_bias = jax.lax.stop_gradient(self.param(
                "score_bias", init_with_names(nn.initializers.zeros, "experts"),
                (m.experts,), jnp.float32))
        weights, experts, scores = route(logits, m, score_bias)
        experts = hook_point(self, "hook_expert_indices", experts.reshape(b, t, -1))
        experts = experts.reshape(b * t, -1)
        if active(self, "hook_expert_weights"):  # every expert's weight, 0 where not chosen
            every = hook_point(self, "hook_expert_weights",
                               dense_weights(weights, experts, m.experts).reshape(b, t, -1))
            weights = jnp.take_along_axis(every.reshape(b * t, -1), experts, axis=-1)

        f = c.expert_d_ff
        names = (("wi_gate", "wi_up") if c.gated_ffn else ("wi",)) + ("wo",)
        w = {}
        for name in names:
            out = name == "wo"
            shape, axes = ((m.experts, f, d), ("experts", "expert_mlp", "embed")) if out else \
                ((m.experts, d, f), ("experts", "embed", "expert_mlp"))
            std = 0.02 / math.sqrt(2 * c.n_layers) if out else 0.02
            w[name] = self.param(name, init_with_names(dense_init(std), *axes), shape,
                                 c.param_dtype)
            if m.bias:
                w[name + "_bias"] = self.param(name + "_bias", init_with_names(
                    nn.initializers.zeros, "experts", axes[2]), (m.experts, shape[2]),
                    c.param_dtype)
        rows = (h, weights, experts) if not m.row.scales_input else \
            scaled_inputs(h, weights, experts)  # Llama 4: a row per assignment, k per token
        y, dropped = dispatch_for(dispatch_of(m))(rows[0].astype(c.dtype), *rows[1:], w,
                                                  FFNS[c.ffn], capacity_factor=m.capacity_factor,
                                                  precision=c.matmul_precision)
        y = jnp.sum(y.reshape(b, t, -1, d), axis=2)  # each token's rows (one, or k) summed

        load = expert_load(experts, m.experts)
        aux, z = balance_losses(logits, scores, load)
        self.sow("moe", "stats", {"load": load, "aux": aux, "z": z, "dropped": dropped})
        if c.shared_d_ff:
            shared = FeedForward(c.replace(d_ff=c.shared_d_ff, dropout=0.0), self.deterministic,
                                 name="shared")(x)
            if m.shared_gate:
                gate = nn.Dense(1, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
                                kernel_init=init_with_names(dense_init(), "embed", "norm"),
                                name="shared_gate")(x)
                shared = jax.nn.sigmoid(gate) * shared
            y = y + shared
        return nn.Dropout(c.dropout)(y, deterministic=self.deterministic)


class Block(nn.Module):
    """One layer: attention and the feed-forward network joined to the residual as
    cfg.block says (jaxformer.model.kinds.BLOCKS), e.g. pre_ln: x + attn(norm(x)), then x + ffn(norm(x)).

    kind: the layer's kind (an index into cfg.kinds: its window and RoPE); a scanned
    Block gets it per layer as `kind_id` instead. sparse: its feed-forward network is
    MoEFeedForward. With ``scanned`` it returns (x, None),
    the carry/output pair nn.scan expects. cross: a decoder block of an encoder-decoder,
    with a cross-attention sublayer (jaxformer.model.cross_attention, params cross_attn) over
    `memory` (a Memory) masked by `cross_rule`, placed by the flow (BlockFlow.cross); its
    keys and values sit in the layer's cache beside the self-attention's.
    mixer: what mixes its tokens (jaxformer.model.mixers.MIXERS): attention, or a recurrent
    module (params `mixer`, reading the segment ids `segments` [B, T] to restart its state;
    its cache holds its state, not keys). ffn: it has a feed-forward network (else the
    flow's mixer_only form). parallel: a recurrent mixer beside the attention (params
    `parallel_mixer`) on the same normed input, its output added to the attention's; its
    entries (state, conv) sit in the layer's cache beside the keys and values. The kind's
    multipliers (LayerKind: mixer_in/out, ffn_gate/out) scale the attention's input and
    output and the FFN's gate and output.
    """

    cfg: ModelConfig
    deterministic: bool = True
    scanned: bool = False
    impl: str | None = None  # the attention backend the model chose for this forward
    kind: int = 0
    sparse: bool = False  # its feed-forward network is the mixture of experts (cfg.moe)
    cross: bool = False  # a cross-attention sublayer (an encoder-decoder's decoder block)
    mixer: str = ATTENTION
    ffn: bool = True
    parallel: str | None = None

    @nn.compact
    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None, kind_id=None,
                 memory=None, cross_rule=None, segments=None):
        """Returns x, or (x, updated cache) when a KV cache is given (always a pair when
        scanned: nn.scan's carry and per-layer output). mask: one MaskRule per layer kind."""
        c = self.cfg
        cross_cache = None
        if self.cross and cache is not None:  # the cross keys/values: a cache of their own
            cross_cache = {n: cache[n] for n in ("cross_k", "cross_v") if n in cache}
            cache = {n: x for n, x in cache.items() if n not in ("cross_k", "cross_v")}
        kind = self.kind if kind_id is None else kind_id
        recurrent = MIXERS[self.mixer].module
        attn = self.mixer_module()
        ffn = self.ffn_module(kind)
        block = self

        def mix(x, layer_cache):  # the kind's mixer on x
            if recurrent is not None:
                return attn(x, segments, layer_cache)
            return attn(x, positions, pick_rule(mask, kind) if isinstance(mask, tuple) else mask,
                        bias, layer_cache, cache_index, kind=kind)

        class Parts:  # what a flow reads (see jaxformer.model.kinds.BLOCKS)
            def norm(self, name, h):  # each flow uses a norm once
                return apply_norm(c, make_norm(c, name), h)

            def attention(self, h):
                nonlocal cache
                out, cache = block.mixed(mix, h, segments, cache, kind)
                return out

            def ffn(self, h):
                return scaled(ffn(h), kind_multiplier(c, kind, "ffn_out_multiplier"))

            def cross_attention(self, h):
                nonlocal cross_cache
                cross = CrossAttention(c, block.deterministic, block.impl, name="cross_attn")
                out = cross(h, memory, cross_rule, cross_cache)
                if cross_cache is not None:
                    out, cross_cache = out
                return out

            def out(self, name, y):
                if c.residual_multiplier != 1.0:
                    y = y * jnp.asarray(c.residual_multiplier, y.dtype)
                return hook_point(block, name, y)

            def hook(self, name, h):
                h = hook_point(block, name, h)
                if block.cross and name == "hook_resid_mid":  # the flow's midpoint
                    h = hook_point(block, "hook_resid_cross", BLOCKS[c.block].cross(self, h))
                return h

        x = hook_point(self, "hook_resid_pre", x)
        flow = BLOCKS[c.block]
        x = (flow.flow if self.ffn and MIXERS[self.mixer].mixes else
             flow.mixer_only if MIXERS[self.mixer].mixes else flow.ffn_only)(Parts(), x)
        x = hook_point(self, "hook_resid_post", constrain(x, "act_batch", "act_seq", "act_embed"))
        if cross_cache is not None:
            cache = {**cache, **cross_cache}
        return (x, cache) if self.scanned or cache is not None else x

    def mixed(self, mix, h, segments, cache, kind):
        """The kind's mixer `mix(x, cache)` on h scaled in and out by the kind's multipliers,
        plus the parallel mixer's on h; and the layer's cache after both (None without)."""
        own, cache = self.split_cache(cache)  # the parallel mixer's entries
        out = mix(scaled(h, kind_multiplier(self.cfg, kind, "mixer_in_multiplier")), cache)
        if cache is not None:
            out, cache = out
        out = scaled(out, kind_multiplier(self.cfg, kind, "mixer_out_multiplier"))
        if self.parallel is None:
            return out, cache
        beside = self.parallel_module()(h, segments, own)
        if own is not None:
            beside, own = beside
            cache = {**cache, **own}
        return out + beside, cache

    def ffn_module(self, kind):
        """The layer's FFN: the mixture of experts (sparse), or dense with its kind's gate
        multiplier."""
        c = self.cfg
        gate = kind_multiplier(c, kind, "ffn_gate_multiplier")
        if self.sparse:
            if gate is not None:
                raise ValueError("model.layer_kinds.<kind>.ffn_gate_multiplier scales a dense "
                                 "FFN's gate; the mixture of experts (model.moe) has none")
            return MoEFeedForward(c, self.deterministic, name="ffn")
        return FeedForward(c, self.deterministic, gate, name="ffn")

    def parallel_module(self):
        """The recurrent mixer beside the attention (params `parallel_mixer`), or None."""
        if self.parallel is None:
            return None
        c = self.cfg
        return MIXERS[self.parallel].module(c, c.mixer_settings(self.parallel),
                                            name="parallel_mixer")

    def split_cache(self, cache):
        """(the parallel mixer's entries of the layer's cache, the rest): (None, cache)
        without a parallel mixer or a cache."""
        if self.parallel is None or cache is None:
            return None, cache
        c = self.cfg
        names = MIXERS[self.parallel].cache(c, c.mixer_settings(self.parallel))
        return ({n: x for n, x in cache.items() if n in names},
                {n: x for n, x in cache.items() if n not in names})

    def mixer_module(self):
        """The layer's mixer: its recurrent module (params `mixer`), or attention (`attn`)."""
        c, recurrent = self.cfg, MIXERS[self.mixer].module
        if recurrent is not None:
            return recurrent(c, c.mixer_settings(self.mixer), name="mixer")
        return (MLAttention if c.mla.on else Attention)(c, self.deterministic, self.impl,
                                                        name="attn")
