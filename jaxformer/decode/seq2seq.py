"""Decoding an encoder-decoder (jaxformer.model.encoder_decoder): the source encoded once, each
decoder layer's cross-attention keys and values computed once (at the first step, kept
in the decoder's KV cache beside its self-attention's), then the loops of
jaxformer.decode.loops: greedy or sampled (seq2seq_generate), or beam search with GNMT's
length penalty (seq2seq_beam_search).

Every target starts with `bos_id` at position 0; the tokens returned are those after it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.attention.cache_formats import cache_format_name
from jaxformer.attention.kv_cache import cache_widths, init_cache
from jaxformer.decode.cached_forward import Generated, checked_inputs, decode_jit
from jaxformer.decode.constraints import Constraints, checked_constraints
from jaxformer.decode.loops import Beams, beam_loop, sample_loop
from jaxformer.decode.sampling import Sampling, checked_sampling
from jaxformer.model.encoder_decoder import EncoderDecoder


def gnmt_penalty(length, alpha: float):
    """GNMT's length penalty (Wu et al. 2016), ((5 + length) / 6) ** alpha: a beam's
    sum of log-probs is divided by it."""
    return ((5.0 + length) / 6.0) ** alpha


def start(model: EncoderDecoder, params, source, lengths, bos_id: int, slots: int,
          cache_dtype=None):
    """Encode the source [B, S] (lengths [B]: the rest is padding) and run BOS through the
    decoder: (logits [B, V] of the first target token, the decoder's cache, the Memory)."""
    b, s = source.shape
    segments = (jnp.arange(s)[None] < lengths[:, None]).astype(jnp.int32)
    memory = model.apply({"params": params}, source, segments, method="encode")
    cache = init_cache(model.cfg, b, slots, cache_dtype)
    bos = jnp.full((b, 1), bos_id, jnp.int32)
    logits, cache = model.apply({"params": params}, bos, memory, jnp.zeros((b, 1), jnp.int32),
                                cache=cache, method="decode")
    return logits[:, 0], cache, memory


def stepper(model: EncoderDecoder, params, memory):
    """forward(tokens [B], positions [B], cache) -> (logits [B, V], cache) over `memory`."""
    def forward(tokens, positions, cache):
        logits, cache = model.apply({"params": params}, tokens[:, None], memory,
                                    positions[:, None], cache=cache, method="decode")
        return logits[:, 0], cache
    return forward


def checked_source(cfg, source, source_lengths, max_new_tokens: int):
    """(source int32 [B, S], lengths int32 [B]) validated; the target (BOS and the new
    tokens) must fit max_seq_len."""
    if max_new_tokens + 1 > cfg.max_seq_len:
        raise ValueError(f"max_new_tokens {max_new_tokens} + the BOS exceeds max_seq_len="
                         f"{cfg.max_seq_len}; ask for fewer tokens")
    return checked_inputs(cfg, source, source_lengths, 1)


def bos_history(b: int, bos_id: int, max_new_tokens: int, constraints: Constraints):
    """The target's tokens a constraint reads (BOS, then room for the new ones), or None."""
    if not constraints.needs_history:
        return None
    return jnp.zeros((b, 1 + max_new_tokens), jnp.int32).at[:, 0].set(bos_id)


@functools.lru_cache(maxsize=32)
def _sampler(cfg, max_new_tokens, bos_id, eos_id, pad_id, cache_dtype, constraints):
    model = EncoderDecoder(cfg)

    def run(params, source, lengths, rng, sampling):
        last, cache, memory = start(model, params, source, lengths, bos_id, max_new_tokens,
                                    cache_dtype)
        history = bos_history(source.shape[0], bos_id, max_new_tokens, constraints)
        return sample_loop(stepper(model, params, memory), last, cache,
                           jnp.ones_like(lengths), rng, sampling, max_new_tokens, eos_id, pad_id,
                           constraints, history)

    return decode_jit(run)


def seq2seq_generate(model: EncoderDecoder, params, source, *, bos_id: int,
                     max_new_tokens: int, rng=None, source_lengths=None,
                     temperature: float = 0.0, top_k=None, top_p=None, min_p=None,
                     eos_id: int | None = None, pad_id: int = 0, cache_dtype=None,
                     constraints: Constraints | None = None) -> Generated:
    """Targets for each row of `source` [B, S] (right-padded; source_lengths [B], None =
    all full): greedy by default (temperature 0), else sampled as jaxformer.decode.loops.generate
    samples (temperature, top_k, top_p, min_p; rng needed). After eos_id a row emits pad_id.
    constraints: jaxformer.decode.constraints.Constraints, as transformers' generate applies them
    (its min_length counts the BOS: min_length m is min_new_tokens m - 1)."""
    cfg = model.cfg
    source, lengths = checked_source(cfg, source, source_lengths, max_new_tokens)
    sampling = checked_sampling(Sampling(temperature=temperature, top_k=top_k, top_p=top_p,
                                         min_p=min_p), source.shape[0], cfg.vocab_size)
    rng = jax.random.key(0) if rng is None else rng
    cache = None if cache_dtype is None else cache_format_name(cache_dtype)
    run = _sampler(cfg, max_new_tokens, bos_id, eos_id, pad_id, cache,
                   checked_constraints(constraints, cfg.vocab_size, eos_id))
    return run(params, source, lengths, rng, sampling)


@functools.lru_cache(maxsize=16)
def _beams(cfg, beam_width, max_new_tokens, alpha, bos_id, eos_id, pad_id, constraints,
           cache_dtype=None):
    model = EncoderDecoder(cfg)

    def run(params, source, lengths):
        last, cache, memory = start(model, params, source, lengths, bos_id, max_new_tokens + 1,
                                    cache_dtype)
        forward = stepper(model, params, memory.repeat(beam_width))  # beams share a source
        return beam_loop(forward, last, cache, jnp.ones_like(lengths), beam_width=beam_width,
                         max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                         n_kv=cache_widths(cfg)[0],
                         normalise=lambda s, n: s / gnmt_penalty(n, alpha),
                         constraints=constraints,
                         history=bos_history(source.shape[0], bos_id, max_new_tokens,
                                             constraints))

    return decode_jit(run)


def seq2seq_beam_search(model: EncoderDecoder, params, source, *, bos_id: int,
                        max_new_tokens: int, beam_width: int = 4, alpha: float = 0.6,
                        eos_id: int | None = None, pad_id: int = 0,
                        source_lengths=None, constraints: Constraints | None = None,
                        cache_dtype=None) -> Beams:
    """The best of `beam_width` beams per row by sum of log-probs / gnmt_penalty(length,
    alpha) (the paper's beam 4, alpha 0.6 by default); a beam that emits eos_id stops, its
    length counting the EOS. scores: the normalised score. constraints, cache_dtype: as
    seq2seq_generate's."""
    cfg = model.cfg
    cache = None if cache_dtype is None else cache_format_name(cache_dtype)
    source, lengths = checked_source(cfg, source, source_lengths, max_new_tokens)
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    fn = _beams(cfg, beam_width, max_new_tokens, float(alpha), bos_id, eos_id, pad_id,
                checked_constraints(constraints, cfg.vocab_size, eos_id), cache)
    return fn(params, source, lengths)
