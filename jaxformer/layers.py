"""Feed-forward networks and the transformer Block: how attention and the feed-forward
network meet the residual (the flows: jaxformer.kinds.BLOCKS)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.attention import Attention, dense_init
from jaxformer.config import ModelConfig
from jaxformer.hooks import hook_point
from jaxformer.kinds import BLOCKS, FFNS
from jaxformer.lora import adapted
from jaxformer.masks import pick_rule
from jaxformer.matmul import flat_dot_general, promote_kernel
from jaxformer.norms import apply_norm, make_norm, normalize  # noqa: F401
from jaxformer.sharding import constrain, init_with_names


class FeedForward(nn.Module):
    """gelu/relu: wo(act(wi x)). swiglu/geglu: wo(act(wi_gate x) * wi_up x)."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        c = self.cfg
        def dense(x, feats, name, names, std=0.02):  # names: the kernel's logical axes
            y = nn.Dense(feats, use_bias=c.use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                         kernel_init=init_with_names(dense_init(std), *names),
                         bias_init=init_with_names(nn.initializers.zeros, names[1]),
                         dot_general=flat_dot_general, promote_dtype=promote_kernel,
                         name=name)(x)
            return adapted(self, c.lora, name, y, x, 1, names, c.dtype, c.param_dtype,
                           self.deterministic)

        act, up = FFNS[c.ffn].activation, ("embed", "mlp")
        pre = hook_point(self, "hook_pre", dense(x, c.d_ff, "wi_gate" if c.gated_ffn else "wi", up))
        h = act(pre)  # [B, T, F]
        if c.gated_ffn:
            h = h * hook_point(self, "hook_pre_linear", dense(x, c.d_ff, "wi_up", up))
        h = hook_point(self, "hook_post", constrain(h, "act_batch", "act_seq", "act_mlp"))
        out = dense(h, c.d_model, "wo", ("mlp", "embed"), 0.02 / math.sqrt(2 * c.n_layers))
        return nn.Dropout(c.dropout)(out, deterministic=self.deterministic)


class Block(nn.Module):
    """One layer: attention and the feed-forward network joined to the residual as
    cfg.block says (jaxformer.kinds.BLOCKS), e.g. pre_ln: x + attn(norm(x)), then x + ffn(norm(x)).

    kind: the layer's kind (an index into cfg.kinds: its window and RoPE); a scanned
    Block gets it per layer as `kind_id` instead. With ``scanned`` it returns (x, None),
    the carry/output pair nn.scan expects.
    """

    cfg: ModelConfig
    deterministic: bool = True
    scanned: bool = False
    impl: str | None = None  # the attention backend the model chose for this forward
    kind: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None, kind_id=None):
        """Returns x, or (x, updated cache) when a KV cache is given (always a pair when
        scanned: nn.scan's carry and per-layer output). mask: one MaskRule per layer kind."""
        c = self.cfg
        kind = self.kind if kind_id is None else kind_id
        attn = Attention(c, self.deterministic, self.impl, name="attn")
        ffn = FeedForward(c, self.deterministic, name="ffn")
        block = self

        class Parts:  # what a flow reads (see jaxformer.kinds.BLOCKS)
            def norm(self, name, h):  # each flow uses a norm once
                return apply_norm(c, make_norm(c, name), h)

            def attention(self, h):
                nonlocal cache
                out = attn(h, positions, pick_rule(mask, kind) if isinstance(mask, tuple)
                           else mask, bias, cache, cache_index, kind=kind)
                if cache is not None:
                    out, cache = out
                return out

            def ffn(self, h):
                return ffn(h)

            def out(self, name, y):
                if c.residual_multiplier != 1.0:
                    y = y * jnp.asarray(c.residual_multiplier, y.dtype)
                return hook_point(block, name, y)

            def hook(self, name, h):
                return hook_point(block, name, h)

        x = hook_point(self, "hook_resid_pre", x)
        x = BLOCKS[c.block].flow(Parts(), x)
        x = hook_point(self, "hook_resid_post", constrain(x, "act_batch", "act_seq", "act_embed"))
        return (x, cache) if self.scanned or cache is not None else x
