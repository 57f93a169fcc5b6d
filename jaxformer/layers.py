"""Norms, feed-forward networks and the transformer Block (pre-LN or post-LN)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax

from jaxformer.attention import Attention, dense_init
from jaxformer.config import ModelConfig
from jaxformer.matmul import flat_dot_general
from jaxformer.sharding import constrain, init_with_names


def make_norm(cfg: ModelConfig, name: str) -> nn.Module:
    """LayerNorm (bias follows use_bias) or RMSNorm; statistics in float32."""
    scale = init_with_names(nn.initializers.ones, "norm")
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                          scale_init=scale, name=name)
    return nn.LayerNorm(epsilon=cfg.norm_eps, use_bias=cfg.use_bias, use_fast_variance=False,
                        dtype=cfg.dtype, param_dtype=cfg.param_dtype, scale_init=scale,
                        bias_init=init_with_names(nn.initializers.zeros, "norm"), name=name)


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's tanh form
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
        def dense(feats, name, names, std=0.02):  # names: the kernel's logical axes
            return nn.Dense(feats, use_bias=c.use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                            kernel_init=init_with_names(dense_init(std), *names),
                            bias_init=init_with_names(nn.initializers.zeros, names[1]),
                            dot_general=flat_dot_general, name=name)

        act, up = ACTIVATIONS[c.ffn], ("embed", "mlp")
        if c.gated_ffn:
            h = act(dense(c.d_ff, "wi_gate", up)(x)) * dense(c.d_ff, "wi_up", up)(x)  # [B, T, F]
        else:
            h = act(dense(c.d_ff, "wi", up)(x))  # [B, T, F]
        h = constrain(h, "act_batch", "act_seq", "act_mlp")
        out = dense(c.d_model, "wo", ("mlp", "embed"), 0.02 / math.sqrt(2 * c.n_layers))(h)
        return nn.Dropout(c.dropout)(out, deterministic=self.deterministic)


class Block(nn.Module):
    """pre_ln:  x + attn(norm(x)), then x + ffn(norm(x))
    post_ln: norm(x + attn(x)),  then norm(x + ffn(x))   (Vaswani et al. 2017)

    With ``scanned`` it returns (x, None), the carry/output pair nn.scan expects.
    """

    cfg: ModelConfig
    deterministic: bool = True
    scanned: bool = False

    @nn.compact
    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None):
        """Returns x, or (x, updated cache) when a KV cache is given (always a pair when
        scanned: nn.scan's carry and per-layer output)."""
        c = self.cfg
        attn = Attention(c, self.deterministic, name="attn")
        ffn = FeedForward(c, self.deterministic, name="ffn")
        attn_norm, ffn_norm = make_norm(c, "attn_norm"), make_norm(c, "ffn_norm")

        def attention(h):
            nonlocal cache
            out = attn(h, positions, mask, bias, cache, cache_index)
            if cache is not None:
                out, cache = out
            return out

        if c.block == "pre_ln":
            x = x + attention(attn_norm(x))
            x = x + ffn(ffn_norm(x))
        else:
            x = attn_norm(x + attention(x))
            x = ffn_norm(x + ffn(x))
        x = constrain(x, "act_batch", "act_seq", "act_embed")
        return (x, cache) if self.scanned or cache is not None else x
