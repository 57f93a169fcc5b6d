"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the config section and the
absorbed attention over a latent cache. Pure math; the module is
jaxformer.model.latent_attention.MLAttention.

Each token's keys and values come from one latent c = RMSNorm(x W_dkv) [kv_lora_rank]
and one rotary key k_r = RoPE(x W_kr) [qk_rope_head_dim] shared by the heads:
  k_n = c W_uk [heads, qk_nope_head_dim],  v = c W_uv [heads, v_head_dim],
  k = [k_n, k_r] per head;  q = [q_n, RoPE(q_r)] from x W_q, or through a low-rank
  query (x W_dq, RMSNorm, W_uq) when q_lora_rank > 0.
Training and a forward without a cache run this expanded form through any backend that
takes values narrower or wider than the keys (Backend.takes_value_width). A KV cache holds
only c and k_r: kv_lora_rank + qk_rope_head_dim numbers per token and layer. Decoding
attends over them in the absorbed form: W_uk folded into the query (q_n W_uk^T, one
[kv_lora_rank] vector per head), W_uv applied after the weighted sum, so no per-head key
or value is ever formed. Its logits are the expanded form's, summed in another order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxformer.core.reference import as_4d, group_sinks, scale_and_mask, softmax
from jaxformer.core.validation import ConfigError, Section, check_number
from jaxformer.positions.schemes import POSITION_SCHEMES


@dataclasses.dataclass(frozen=True)
class MLAConfig(Section):
    """model.mla: multi-head latent attention; kv_lora_rank 0: none (every layer's
    attention is the usual multi-head one).

    kv_lora_rank: the latent's width (the cache holds it and the rotary key per token).
    q_lora_rank: the low-rank query's width (0: a full query projection, DeepSeek-V2-Lite).
    qk_nope_head_dim, qk_rope_head_dim: each head's query/key slice without and with RoPE
    (model.head_dim is their sum; a rotary scheme rotates the second alone, the decoupled
    key shared by the heads); v_head_dim: each head's value width.
    """

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    SECTION = "model.mla"

    def __post_init__(self):
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            check_number(self.SECTION, name, getattr(self, name), int, low=0)
        if not self.kv_lora_rank:
            return
        for name in ("qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.mla.{name}={getattr(self, name)} must be >= 1 when "
                                  f"model.mla.kv_lora_rank={self.kv_lora_rank} turns MLA on")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE "
                              "rotates pairs of dimensions")

    @property
    def on(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check_model(self, cfg) -> None:
        """What MLA asks of the rest of the model (cfg a ModelConfig with sizes resolved),
        each refusal one line."""
        if cfg.head_dim != self.qk_head_dim:
            raise ConfigError(f"model.head_dim={cfg.head_dim} must be model.mla.qk_nope_head_dim "
                              f"+ qk_rope_head_dim = {self.qk_nope_head_dim} + "
                              f"{self.qk_rope_head_dim} = {self.qk_head_dim} (or unset)")
        if cfg.n_kv_heads != cfg.n_heads:
            raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads}: MLA gives every head its own "
                              f"keys and values from the latent; leave it unset (= n_heads)")
        if POSITION_SCHEMES[cfg.position].kind == "contextual":
            raise ConfigError(f"model.position={cfg.position!r} computes its logits from whole "
                              "rows of expanded keys, which MLA's decoding over latents never "
                              "forms; use a rotary, bias or absolute scheme")
        for name, plain in (("qk_norm", "none"), ("rope_fraction", 1.0), ("p_rope", 1.0),
                            ("attn_output_gate", False)):
            if getattr(cfg, name, plain) != plain:
                raise ConfigError(f"model.{name}={getattr(cfg, name)!r} is not for MLA, whose "
                                  "latent has its own norm and whose rotated slice is "
                                  "model.mla.qk_rope_head_dim; leave it unset")
        named = [t for t in cfg.lora.targets if t in ("query", "key", "value")]
        if cfg.lora.rank and named:
            raise ConfigError(f"model.lora.targets names {', '.join(named)}, which an MLA layer "
                              "does not have (its queries, keys and values come through the "
                              "latents); target out, the MLP, or all")


def latent_attention(q_latent, q_rope, latent, rope_key, *, mask=None, bias=None,
                     scale=None, softcap=None, sinks=None):
    """The absorbed form over a latent cache: q_latent [B, T, N, R] (q_n W_uk^T), q_rope
    [B, T, N, P] (rotated), latent [B, S, R], rope_key [B, S, P] (rotated) -> the weighted
    sum of latents [B, T, N, R] (W_uv is applied after). Logits (q_latent . c + q_rope .
    k_r) * scale (default 1 / sqrt(nope + rope) is the caller's to give), soft-capped,
    biased, masked (mask, bias broadcast to [B, N, T, S]) and softmaxed in float32 as the
    reference; one latent for every head, as MQA with K = 1."""
    logits = (wide_einsum("btnr,bsr->bnts", q_latent, latent)
              + wide_einsum("btnp,bsp->bnts", q_rope, rope_key))  # [B, N, T, S]
    logits = scale_and_mask(logits[:, None], mask=as_4d(mask), bias=as_4d(bias),
                            scale=scale, softcap=softcap)  # [B, 1, N, T, S]
    w = softmax(logits, group_sinks(sinks, 1))[:, 0]  # [B, N, T, S]
    return wide_einsum("bnts,bsr->btnr", w.astype(latent.dtype), latent).astype(q_latent.dtype)


def wide_einsum(spec: str, a, b):
    """jnp.einsum(spec, a, b) accumulated in and returned as float32, whatever a's and b's
    float dtypes. XLA:CPU's thunk runtime has no bf16 x bf16 -> f32 dot, and a decode
    step's dot that it leaves unfused (the weighted sum of latents at batch 2) fails there
    ("Unsupported element type for DotThunk"): on CPU the operands are upcast to float32
    first. A product of two bf16 (or f16) numbers is exact in float32, so only the order
    of the float32 sums may differ; elsewhere (GPU, TPU) the operands go in as they are."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def default_scale(mla: MLAConfig) -> float:
    """The logits' scale of an MLA layer: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)."""
    return 1.0 / math.sqrt(mla.qk_head_dim)
