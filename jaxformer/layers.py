"""Feed-forward networks and the transformer Block: how attention and the feed-forward
network meet the residual (BLOCK_FLOWS, one entry per model.block)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import Attention, dense_init
from jaxformer.config import ModelConfig
from jaxformer.hooks import hook_point
from jaxformer.lora import adapted
from jaxformer.masks import pick_rule
from jaxformer.matmul import flat_dot_general, promote_kernel
from jaxformer.norms import apply_norm, make_norm, normalize  # noqa: F401
from jaxformer.sharding import constrain, init_with_names


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's tanh form
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),  # the erf form (GPT-NeoX)
    "relu": jax.nn.relu,
    "swiglu": jax.nn.silu,
    "geglu": lambda x: jax.nn.gelu(x, approximate=True),
}


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

        act, up = ACTIVATIONS[c.ffn], ("embed", "mlp")
        pre = hook_point(self, "hook_pre", dense(x, c.d_ff, "wi_gate" if c.gated_ffn else "wi", up))
        h = act(pre)  # [B, T, F]
        if c.gated_ffn:
            h = h * hook_point(self, "hook_pre_linear", dense(x, c.d_ff, "wi_up", up))
        h = hook_point(self, "hook_post", constrain(h, "act_batch", "act_seq", "act_mlp"))
        out = dense(h, c.d_model, "wo", ("mlp", "embed"), 0.02 / math.sqrt(2 * c.n_layers))
        return nn.Dropout(c.dropout)(out, deterministic=self.deterministic)


# ---- blocks: how the sublayers meet the residual, one entry per model.block -------------
# Each flow takes the Block's `b` (b.norm(name, x): that norm, created on first use;
# b.attention(h), b.ffn(h): the sublayers; b.out(hook, y): y times residual_multiplier, hooked
# as the sublayer's output; b.hook(name, x)) and the residual x, and returns the new x.

def _pre_ln(b, x):
    x = x + b.out("hook_attn_out", b.attention(b.norm("attn_norm", x)))
    x = b.hook("hook_resid_mid", x)
    return x + b.out("hook_mlp_out", b.ffn(b.norm("ffn_norm", x)))


def _post_ln(b, x):
    x = b.hook("hook_resid_mid", b.norm("attn_norm", x + b.out("hook_attn_out", b.attention(x))))
    return b.norm("ffn_norm", x + b.out("hook_mlp_out", b.ffn(x)))


def _sandwich(b, x):
    x = x + b.out("hook_attn_out", b.norm("attn_post_norm", b.attention(b.norm("attn_norm", x))))
    x = b.hook("hook_resid_mid", x)
    return x + b.out("hook_mlp_out", b.norm("ffn_post_norm", b.ffn(b.norm("ffn_norm", x))))


def _res_post_ln(b, x):
    x = x + b.out("hook_attn_out", b.norm("attn_post_norm", b.attention(x)))
    x = b.hook("hook_resid_mid", x)
    return x + b.out("hook_mlp_out", b.norm("ffn_post_norm", b.ffn(x)))


def _parallel(b, x):
    attn = b.out("hook_attn_out", b.attention(b.norm("attn_norm", x)))
    return x + attn + b.out("hook_mlp_out", b.ffn(b.norm("ffn_norm", x)))


def _parallel_shared_ln(b, x):
    h = b.norm("attn_norm", x)
    return x + b.out("hook_attn_out", b.attention(h)) + b.out("hook_mlp_out", b.ffn(h))


BLOCK_FLOWS = {"pre_ln": _pre_ln, "post_ln": _post_ln, "sandwich": _sandwich,
               "res_post_ln": _res_post_ln, "parallel": _parallel,
               "parallel_shared_ln": _parallel_shared_ln}


class Block(nn.Module):
    """One layer: attention and the feed-forward network joined to the residual as
    cfg.block says (BLOCK_FLOWS), e.g. pre_ln: x + attn(norm(x)), then x + ffn(norm(x)).

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

        class Parts:  # what a flow reads (see BLOCK_FLOWS)
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
        x = BLOCK_FLOWS[c.block](Parts(), x)
        x = hook_point(self, "hook_resid_post", constrain(x, "act_batch", "act_seq", "act_embed"))
        return (x, cache) if self.scanned or cache is not None else x
