"""Where `auto` picks each attention backend, and why: the Setting it decides from and one
rule per backend (jaxformer.attention.backends.BACKENDS names them as each entry's `auto`). A rule
returns why it picks its backend in a setting ('' to pick it silently), or None; exactly
one answers for any setting (tests/attention/test_backends.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxformer.positions.schemes import POSITION_SCHEMES

DENSE_LOGITS_BYTES = 1 << 30  # auto: above this, float32 [B, N, Tq, Tk] logits go blockwise
GATHERED_KV_BYTES = 64 << 20  # auto: up to this, one layer's whole K/V is gathered


def scheme_kind(position: str | None) -> str | None:
    """The kind of position scheme `position` (jaxformer.positions.schemes), None for no scheme."""
    return None if position not in POSITION_SCHEMES else POSITION_SCHEMES[position].kind


@dataclasses.dataclass(frozen=True)
class Setting:
    """What `auto` decides from: the platform, the compute dtype, head_dim, the position
    scheme, one layer's dense float32 logits, B * N * Tq * Tk * 4 bytes, whether the
    logits are soft-capped (then only a backend with takes_softcap answers; sinks
    likewise), and whether the layers' windows are data (scanned layer kinds with
    different windows: splash needs them static)."""

    platform: str
    dtype: Any
    head_dim: int
    position: str | None
    logits_bytes: int
    softcap: bool = False
    window_as_data: bool = False
    context: int = 1  # devices the sequence is split over (mesh.context)
    kv_bytes: int = 0  # one layer's keys and values of the whole sequence, in bytes
    sinks: bool = False  # the rows' softmax has attention sinks (only takes_sinks answers)
    value_width: bool = False  # values of another width than the keys (MLA), likewise

    @property
    def unfused(self) -> bool:
        """Something jax.nn.dot_product_attention (xla, cudnn) cannot run."""
        return self.softcap or self.sinks or self.value_width

    @property
    def biased(self) -> bool:
        return scheme_kind(self.position) == "bias"

    @property
    def contextual(self) -> bool:
        return scheme_kind(self.position) == "contextual"

    @property
    def big(self) -> bool:
        return self.logits_bytes > DENSE_LOGITS_BYTES

    @property
    def cudnn_fits(self) -> bool:
        """cuDNN's flash kernel takes it: a GPU, 16-bit inputs, head_dim a multiple of 8 up
        to 128, no bias too big to hand it densely, and no soft-cap (it takes none)."""
        return self.platform == "gpu" and jnp.dtype(self.dtype) in (jnp.bfloat16, jnp.float16) \
            and self.head_dim % 8 == 0 and self.head_dim <= 128 and not (self.biased and self.big) \
            and not self.unfused



def context(gather: bool):
    """ring (gather False) or all_gather: exactly when the sequence is split, by the size of
    one layer's keys and values."""
    def auto(s: Setting) -> str | None:
        if s.context == 1 or (s.kv_bytes <= GATHERED_KV_BYTES) != gather:
            return None
        return (f"the sequence is split over {s.context} devices and one layer's keys and "
                f"values take {s.kv_bytes / 2**20:.1f} MiB "
                f"({'<=' if gather else '>'} GATHERED_KV_BYTES = {GATHERED_KV_BYTES >> 20} MiB)")
    return auto


def _budget(s: Setting) -> str:
    return (f"dense logits would take {s.logits_bytes / 2**30:.1f} GiB per layer "
            f"(> DENSE_LOGITS_BYTES = {DENSE_LOGITS_BYTES / 2**30:g} GiB)")


_NO_SOFTCAP = ("the logits are soft-capped, which xla and cudnn "
               "(jax.nn.dot_product_attention) do not take")
_NO_SINKS = "the attention has sinks, which xla and cudnn (jax.nn.dot_product_attention) lack"
_NO_VALUE_WIDTH = ("the values are not as wide as the keys (MLA), which xla and cudnn "
                   "(jax.nn.dot_product_attention) need")


def _not_fused(s: Setting) -> str:  # why a dense backend answers off the CPU instead of xla
    return _NO_SOFTCAP if s.softcap else _NO_SINKS if s.sinks else _NO_VALUE_WIDTH


def blockwise(s: Setting) -> str | None:
    if s.platform == "tpu":
        if s.sinks or s.value_width:
            what = "the attention has sinks" if s.sinks else "the values are not as wide as the keys"
            return f"a TPU, and {what}, which the splash kernel does not take"
        if s.window_as_data:
            return "a TPU, and the scanned layers' windows differ, which splash needs static"
        return (f"a TPU, and position={s.position!r} adds a logit bias, which the splash "
                "kernel does not take") if s.biased else None
    if s.big and not s.cudnn_fits:
        return _budget(s) + (f" and position={s.position!r}'s bias with them"
                             if s.platform == "gpu" and s.biased else "") + (
            f"; {_not_fused(s)}" if s.unfused and s.platform != "cpu" else "")
    return None


def chunked(s: Setting) -> str | None:
    """Dense logits within the budget: on a CPU always (its fastest backend), elsewhere
    off TPUs when the logits are soft-capped or have sinks (instead of xla or cudnn)."""
    if not _dense_fits(s):
        return None
    if s.platform == "cpu":
        return ""
    return f"{_not_fused(s)}; the dense logits fit the budget" if s.unfused else None


def _dense_fits(s: Setting) -> bool:
    return s.platform != "tpu" and not s.big and not s.cudnn_fits


def reference(s: Setting) -> str | None:
    return f"position={s.position!r} computes the logits from whole rows of keys" \
        if s.contextual else None


def xla(s: Setting) -> str | None:
    return "" if _dense_fits(s) and s.platform != "cpu" and not s.unfused else None


def cudnn(s: Setting) -> str | None:
    return "a GPU, 16-bit inputs, head_dim a multiple of 8 up to 128" if s.cudnn_fits else None


def splash(s: Setting) -> str | None:
    return "a TPU, and no logit bias" if s.platform == "tpu" and not s.biased \
        and not s.window_as_data and not s.sinks and not s.value_width else None
