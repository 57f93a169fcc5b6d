"""The model as the decoders run it (jaxformer.decode.loops, jaxformer.decode.speculative): inputs
checked, layers looped, a prompt prefilled into a KV cache, one token forward."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention.kv_cache import check_generates, init_cache
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import Transformer, unstack_layers


class Generated(NamedTuple):
    tokens: jax.Array    # int32 [batch, max_new_tokens]; pad_id after a row's EOS
    logprobs: jax.Array  # float32 [batch, max_new_tokens]: log p(token) under the model
    lengths: jax.Array   # int32 [batch]: tokens generated, the EOS included
    drafted: jax.Array | None = None   # int32 [batch]: tokens a draft proposed (speculative)
    accepted: jax.Array | None = None  # int32 [batch]: of those, the ones the model kept

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens kept / drafted, over the batch (speculative decoding only)."""
        return float(np.sum(self.accepted) / max(int(np.sum(self.drafted)), 1))


def concrete(x):
    """x as a NumPy array, or None when it is traced (under jit/vmap: checked at trace time
    only for its shape)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def checked_inputs(cfg: ModelConfig, prompts, prompt_lengths, max_new_tokens: int,
                   room: int = 0, *, eos_id: int | None = None, pad_id: int | None = None):
    """Validated (prompts int32 [B, W], lengths int32 [B]); errors name the bad input.
    room: positions past the last new token that decoding also writes (a draft's);
    eos_id / pad_id: checked to be in the vocabulary."""
    check_generates(cfg)  # an encoder: one line, before anything compiles
    if not isinstance(prompts, jax.Array):
        prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be [batch, width] with width >= 1, got shape "
                         f"{prompts.shape}")
    b, width = prompts.shape
    if b == 0:
        raise ValueError(f"prompts has no rows (shape {prompts.shape}); pass at least one prompt")
    if not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts must be integer token ids, got dtype {prompts.dtype}; "
                         "pass the tokenizer's ids (e.g. np.int32)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not 0 <= int(value) < cfg.vocab_size:
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {cfg.vocab_size}); "
                             f"pass an id below {cfg.vocab_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if width + max_new_tokens + room > cfg.max_seq_len:
        extra = f" + draft_len {room}" if room else ""
        raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens}{extra} = "
                         f"{width + max_new_tokens + room} exceeds max_seq_len="
                         f"{cfg.max_seq_len}; shorten one of them")
    ids = concrete(prompts)
    if ids is not None and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}); got "
                         f"min {ids.min()}, max {ids.max()}")
    if prompt_lengths is None:
        return jnp.asarray(prompts, jnp.int32), jnp.full((b,), width, jnp.int32)
    lengths = concrete(prompt_lengths)
    if lengths is not None and (lengths.shape != (b,) or lengths.min() < 1 or
                                lengths.max() > width):
        raise ValueError(f"prompt_lengths must be {b} values in [1, {width}], got "
                         f"{lengths.tolist()}")
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)


def prefill(model, params, prompts, lengths, max_len, cache_dtype, windowed, spare=0):
    """Fill the cache (windowed: rings for windowed layers, `spare` slots beyond their
    window) with the prompts (padding marked empty); logits of each row's last real token
    [B, V]."""
    b, w = prompts.shape
    cache = init_cache(model.cfg, b, max_len, cache_dtype, windowed=windowed, spare=spare)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    real = (positions < lengths[:, None]).astype(jnp.int32)  # segment id 0 = padding
    logits, cache = model.apply({"params": params}, prompts, positions, real, cache=cache)
    return logits[jnp.arange(b), lengths - 1], cache


def forward_one(model, params, tokens, positions, cache):
    """tokens, positions [B] -> logits [B, V], cache."""
    logits, cache = model.apply({"params": params}, tokens[:, None], positions[:, None],
                                cache=cache)
    return logits[:, 0], cache


# XLA:CPU compiles for 256-bit vectors by default; a decode step is ~220 small fusions
# (norms, softmax over the cache, biases, residuals) beside its matrix-vector products, and
# with 512-bit vectors preferred it ran 8-15% faster on an AVX-512 Xeon (bench/decode.py;
# a CPU without AVX-512 has no such vectors to prefer)
CPU_DECODE_OPTIONS = {"xla_cpu_prefer_vector_width": 512}


def decode_jit(fn):
    """jax.jit for a decoder's whole run: on CPU with CPU_DECODE_OPTIONS, except when it is
    traced inside another jit or vmap, where the outer program's options hold (jax takes
    compiler options at the top level only)."""
    plain = jax.jit(fn)
    if jax.default_backend() != "cpu":
        return plain
    tuned = jax.jit(fn, compiler_options=CPU_DECODE_OPTIONS)

    def call(*args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return plain(*args)
        return tuned(*args)

    call.lower = tuned.lower
    return call


def decoding_config(cfg: ModelConfig) -> ModelConfig:
    """The config the decoders run: layers unscanned, and a mixture of experts dropless.

    A capacity buffer (model.moe.capacity_factor) is a training option: its C slots per
    expert are a share of the tokens in one forward, so what a token gets would hang on how
    many tokens run beside it (a prompt of 100, one decode step, the other rows and their
    padding), and a cached decode could not equal the full forward. Decoding runs those
    experts dropless: every token reaches its top_k experts, the model the capacity
    approximates when nothing overflows (jaxformer.moe.experts)."""
    if cfg.scan_layers:
        cfg = cfg.replace(scan_layers=False)
    if cfg.moe.capacity_factor is not None:
        cfg = cfg.replace(moe=cfg.moe.replace(capacity_factor=None, dispatch=None))
    return cfg


def looped(cfg: ModelConfig):
    """The model decoding runs (decoding_config), and a map to its params from the
    caller's: scanned layers run as a Python loop over unstacked params, since inside the
    decode loop nn.scan slices every layer's params and cache out of the stacked arrays on
    every step (4-6x slower)."""
    model = Transformer(decoding_config(cfg))
    return model, (unstack_layers if cfg.scan_layers else lambda params: params)
