"""Norms, feed-forward networks and the transformer Block (pre-LN or post-LN)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import Attention, dense_init
from jaxformer.config import ModelConfig
from jaxformer.hooks import active, hook_point
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


def normalize(cfg: ModelConfig, x):
    """x [..., D] normalised in float32, before the norm's scale and bias: (x - mean) /
    std for LayerNorm, x / rms for RMSNorm."""
    x = x.astype(jnp.float32)
    if cfg.norm == "rmsnorm":
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps)
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                                   + cfg.norm_eps)


def apply_norm(cfg: ModelConfig, norm: nn.Module, x):
    """norm(x). When jaxformer.inspect reads or hooks its `hook_normalized` (the normalised
    x before the scale and bias, float32, as TransformerLens has it), the norm is computed
    here from its params, around that hook point."""
    y = norm(x)
    if not active(norm, "hook_normalized"):
        return y
    p = norm.variables["params"]
    h = hook_point(norm, "hook_normalized", normalize(cfg, x)) * p["scale"].astype(jnp.float32)
    if "bias" in p:
        h = h + p["bias"].astype(jnp.float32)
    return h.astype(y.dtype)


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
        def dense(feats, name, names, std=0.02):  # names: the kernel's logical axes
            return nn.Dense(feats, use_bias=c.use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                            kernel_init=init_with_names(dense_init(std), *names),
                            bias_init=init_with_names(nn.initializers.zeros, names[1]),
                            dot_general=flat_dot_general, name=name)

        act, up = ACTIVATIONS[c.ffn], ("embed", "mlp")
        pre = hook_point(self, "hook_pre", dense(c.d_ff, "wi_gate" if c.gated_ffn else "wi", up)(x))
        h = act(pre)  # [B, T, F]
        if c.gated_ffn:
            h = h * hook_point(self, "hook_pre_linear", dense(c.d_ff, "wi_up", up)(x))
        h = hook_point(self, "hook_post", constrain(h, "act_batch", "act_seq", "act_mlp"))
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
    impl: str | None = None  # the attention backend the model chose for this forward

    @nn.compact
    def __call__(self, x, positions, mask, bias=None, cache=None, cache_index=None):
        """Returns x, or (x, updated cache) when a KV cache is given (always a pair when
        scanned: nn.scan's carry and per-layer output)."""
        c = self.cfg
        attn = Attention(c, self.deterministic, self.impl, name="attn")
        ffn = FeedForward(c, self.deterministic, name="ffn")
        attn_norm, ffn_norm = make_norm(c, "attn_norm"), make_norm(c, "ffn_norm")

        def attention(h):
            nonlocal cache
            out = attn(h, positions, mask, bias, cache, cache_index)
            if cache is not None:
                out, cache = out
            return out

        x = hook_point(self, "hook_resid_pre", x)
        if c.block == "pre_ln":
            x = x + hook_point(self, "hook_attn_out", attention(apply_norm(c, attn_norm, x)))
            x = hook_point(self, "hook_resid_mid", x)
            x = x + hook_point(self, "hook_mlp_out", ffn(apply_norm(c, ffn_norm, x)))
        else:
            x = x + hook_point(self, "hook_attn_out", attention(x))
            x = hook_point(self, "hook_resid_mid", apply_norm(c, attn_norm, x))
            x = x + hook_point(self, "hook_mlp_out", ffn(x))
            x = apply_norm(c, ffn_norm, x)
        x = hook_point(self, "hook_resid_post", constrain(x, "act_batch", "act_seq", "act_embed"))
        return (x, cache) if self.scanned or cache is not None else x
