"""LFM2's gated short convolution (Liquid AI 2025): B, C, x = in_proj(h) (three D -> D
projections); y = out_proj(C * conv(B * x)), conv the short causal depthwise convolution
(jaxformer.recurrent.conv) over the model's width. Its decode cache is the convolution's
last kernel - 1 inputs."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn

from jaxformer.core.hooks import hook_point
from jaxformer.core.matmul import projection_dot, promote_kernel
from jaxformer.core.sharding import constrain, init_with_names
from jaxformer.core.validation import Section, check_number
from jaxformer.recurrent.conv import causal_conv


@dataclasses.dataclass(frozen=True)
class ShortConvSettings(Section):
    """model.mixer.short_conv. kernel: the convolution's taps (LFM2's conv_L_cache);
    bias: biases on the projections and the convolution (LFM2's conv_bias)."""

    kernel: int = 3
    bias: bool = False

    SECTION = "model.mixer.short_conv"

    def __post_init__(self):
        check_number(self.SECTION, "kernel", self.kernel, int, low=1)


def cache_shapes(cfg, s: ShortConvSettings):
    """One row's cache: the last kernel - 1 inputs of the convolution [K - 1, D]."""
    return {"conv": ((s.kernel - 1, cfg.d_model), None)}


def flops(cfg, s: ShortConvSettings, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward: 3x the forward): 6 per weight of the
    four D x D projections, and 3x the convolution's 2 kernel and the gates' 2 per channel."""
    return 6.0 * 4 * cfg.d_model ** 2 + 3.0 * (2 * s.kernel + 2) * cfg.d_model


def projection(cfg, feats: int, names, bias: bool, name: str, std: float = 0.02):
    """A mixer's dense projection, its kernel's logical axes `names`, in the model's dtypes."""
    return nn.Dense(feats, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=init_with_names(nn.initializers.normal(std), *names),
                    bias_init=init_with_names(nn.initializers.zeros, names[-1]),
                    dot_general=projection_dot(cfg.matmul_precision),
                    promote_dtype=promote_kernel, name=name)


class ShortConvMixer(nn.Module):
    """Params: in_b, in_c, in_x [D, D] (HF's in_proj in thirds), conv [K, D] (+ conv_bias),
    out [D, D]. Hooks: hook_conv_in (B * x) and hook_conv_out (the convolution's output)."""

    cfg: object
    settings: ShortConvSettings

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None):  # x [B, T, D]
        c, s = self.cfg, self.settings
        inner = ("embed", "mlp")
        gate_b, gate_c, h = (projection(c, c.d_model, inner, s.bias, n)(x)
                             for n in ("in_b", "in_c", "in_x"))
        w = self.param("conv", init_with_names(nn.initializers.normal(0.1), "conv_taps", "mlp"),
                       (s.kernel, c.d_model), c.param_dtype)
        bias = self.param("conv_bias", init_with_names(nn.initializers.zeros, "mlp"),
                          (c.d_model,), c.param_dtype) if s.bias else None
        u = hook_point(self, "hook_conv_in", gate_b * h)  # [B, T, D]
        y, tail = causal_conv(u, w.astype(c.dtype), None if bias is None else bias.astype(
            c.dtype), segment_ids, None if cache is None else cache["conv"])
        y = hook_point(self, "hook_conv_out", y)
        y = constrain(gate_c * y, "act_batch", "act_seq", "act_mlp")
        out = projection(c, c.d_model, ("mlp", "embed"), s.bias, "out",
                         0.02 / math.sqrt(2 * c.n_layers))(y)
        return out if cache is None else (out, {"conv": tail.astype(cache["conv"].dtype)})
