"""The layer kinds as tables, one row per value of model.norm, model.ffn, model.block,
model.qk_norm and model.remat: what each variant is, read by config validation (its
choices) and by the layers (its math). Nothing else names a variant: a new norm, FFN or
block flow is one row here. Pure math and plain functions: no Flax module, no config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Norm:
    """rms: the statistics are x / rms(x) (else (x - mean) / std, and a bias if the model
    has biases). scale_offset: the scale multiplies as offset + w, w initialised at
    1 - offset (Gemma's RMSNorm: 1 + w, w from 0)."""

    rms: bool
    scale_offset: float = 0.0


NORMS = {"layernorm": Norm(rms=False), "rmsnorm": Norm(rms=True),
         "rmsnorm_offset": Norm(rms=True, scale_offset=1.0)}


@dataclasses.dataclass(frozen=True)
class FFN:
    """activation: act in wo(act(wi x)), or wo(act(wi_gate x) * wi_up x) when gated.
    glu: a gated FFN's own join of the two projections, wo(glu(wi_gate x, wi_up x)), where
    it is not act(gate) * up. scalars: the activation's learned scalars per layer (params of
    the ffn module, name -> initial value), passed as act(x, **scalars); fixed: those of
    them that take no gradient (a checkpoint's buffers)."""

    activation: Callable
    gated: bool = False
    glu: Callable | None = None
    scalars: Mapping[str, float] = dataclasses.field(default_factory=dict)
    fixed: tuple[str, ...] = ()

    def join(self, gate, up):
        """A gated FFN's hidden activation from its gate and up projections."""
        return self.activation(gate) * up if self.glu is None else self.glu(gate, up)


def _gelu_tanh(x):  # GPT-2's tanh form
    return jax.nn.gelu(x, approximate=True)


def _gelu_erf(x):  # the erf form (GPT-NeoX)
    return jax.nn.gelu(x, approximate=False)


CLAMP_ALPHA, CLAMP_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def _clamped_swiglu(gate, up):
    """gpt-oss: gate clamped above and up to [-limit, limit] at 7, then
    (up + 1) * gate * sigmoid(1.702 gate)."""
    gate = jnp.minimum(gate, CLAMP_LIMIT)
    up = jnp.clip(up, -CLAMP_LIMIT, CLAMP_LIMIT)
    return (up + 1) * gate * jax.nn.sigmoid(CLAMP_ALPHA * gate)


def _relu2(x):  # squared ReLU (Primer; Nemotron-H's MLP)
    return jnp.square(jax.nn.relu(x))


def _xielu(x, alpha_p, alpha_n, beta, eps):
    """xIELU (Huang et al. 2024; Apertus): with a_p = softplus(alpha_p) and
    a_n = beta + softplus(alpha_n), a_p x^2 + beta x for x > 0, else
    a_n (expm1(min(x, eps)) - x) + beta x."""
    a_p, a_n = jax.nn.softplus(alpha_p), beta + jax.nn.softplus(alpha_n)
    negative = (jnp.expm1(jnp.minimum(x, eps)) - x) * a_n
    return jnp.where(x > 0, a_p * x * x, negative) + beta * x


# xIELU's initial scalars as transformers draws them: a_p = a_n = 0.8 after the softplus
XIELU_INIT = {"alpha_p": math.log(math.expm1(0.8)), "alpha_n": math.log(math.expm1(0.8 - 0.5)),
              "beta": 0.5, "eps": -1e-6}

FFNS = {"gelu": FFN(_gelu_tanh), "gelu_exact": FFN(_gelu_erf), "relu": FFN(jax.nn.relu),
        "relu2": FFN(_relu2),
        "swiglu": FFN(jax.nn.silu, gated=True), "geglu": FFN(_gelu_tanh, gated=True),
        "clamped_swiglu": FFN(jax.nn.silu, gated=True, glu=_clamped_swiglu),
        "xielu": FFN(_xielu, scalars=XIELU_INIT, fixed=("beta", "eps"))}


# ---- blocks: how the sublayers meet the residual -----------------------------------------
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


# a layer without a feed-forward network (Mamba-2's, Nemotron-H's): its mixer alone


def _pre_ln_mixer_only(b, x):
    return x + b.out("hook_attn_out", b.attention(b.norm("attn_norm", x)))


# a layer of its feed-forward network alone (mixer none: Nemotron-H's MLP layers)


def _pre_ln_ffn_only(b, x):
    return x + b.out("hook_mlp_out", b.ffn(b.norm("ffn_norm", x)))


# the cross-attention sublayer of an encoder-decoder's decoder block (b.cross_attention(h)),
# joined to the residual in its flow's own manner, between self-attention and the FFN


def _cross_pre_ln(b, x):
    return x + b.out("hook_cross_out", b.cross_attention(b.norm("cross_norm", x)))


def _cross_post_ln(b, x):
    return b.norm("cross_norm", x + b.out("hook_cross_out", b.cross_attention(x)))


def _cross_sandwich(b, x):
    return x + b.out("hook_cross_out", b.norm("cross_post_norm",
                                              b.cross_attention(b.norm("cross_norm", x))))


def _cross_res_post_ln(b, x):
    return x + b.out("hook_cross_out", b.norm("cross_post_norm", b.cross_attention(x)))


@dataclasses.dataclass(frozen=True)
class BlockFlow:
    """flow(b, x) -> x (above). ends_in_norm: the block's last step is a norm (post-LN),
    so the model adds no final norm before the head. cross(b, x) -> x: the cross-attention
    sublayer as this flow joins it, run at the flow's midpoint (hook_resid_mid) in a
    decoder block of an encoder-decoder; None where the flow has no midpoint (parallel).
    mixer_only(b, x) -> x: a layer with no feed-forward network in this flow's manner
    (None: the flow has no such form); ffn_only(b, x) -> x: a layer without a mixer."""

    flow: Callable
    ends_in_norm: bool = False
    cross: Callable | None = None
    mixer_only: Callable | None = None
    ffn_only: Callable | None = None


BLOCKS = {"pre_ln": BlockFlow(_pre_ln, cross=_cross_pre_ln, mixer_only=_pre_ln_mixer_only,
                             ffn_only=_pre_ln_ffn_only),
          "post_ln": BlockFlow(_post_ln, ends_in_norm=True, cross=_cross_post_ln),
          "sandwich": BlockFlow(_sandwich, cross=_cross_sandwich),
          "res_post_ln": BlockFlow(_res_post_ln, cross=_cross_res_post_ln),
          "parallel": BlockFlow(_parallel), "parallel_shared_ln": BlockFlow(_parallel_shared_ln)}


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """The logical axes of the query and key norms' scales (None: no QK-norm): per head
    over head_dim (Qwen3, Gemma 3), or over the whole projection (OLMo 2). after_rope: the
    norms take the rotated queries and keys (Hunyuan), else they are normed, then rotated."""

    query_axes: tuple[str, ...] | None = None
    key_axes: tuple[str, ...] | None = None
    after_rope: bool = False
    scale: bool = True  # False: x / rms(x) alone, no weight (Llama 4's L2 norm)


QK_NORMS = {"none": QKNorm(), "head": QKNorm(("head_dim",), ("head_dim",)),
            "projection": QKNorm(("heads", "head_dim"), ("kv_heads", "head_dim")),
            "head_after_rope": QKNorm(("head_dim",), ("head_dim",), after_rope=True),
            "l2": QKNorm(("head_dim",), ("head_dim",), scale=False)}


@dataclasses.dataclass(frozen=True)
class Remat:
    """Whether a block is rematerialised, and what its backward may keep (policy None:
    nothing, recompute it all)."""

    on: bool
    policy: Any = None


REMATS = {"none": Remat(on=False), "full": Remat(on=True),
          "dots": Remat(on=True, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)}
