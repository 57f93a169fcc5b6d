"""KV-cached decoding: one prefill forward over the prompt batch, then a fixed-length
jax.lax.scan of single-token steps; greedy, temperature, top-k, top-p and beam search.

The cache (its layout, writes and reads: jaxformer.kv_cache) is an explicit pytree
updated in place; every row writes its next token into the same slot, so rows with
prompts of different lengths decode together, each at its own positions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import ModelConfig
from jaxformer.hooks import session
from jaxformer.kv_cache import init_cache, kv_cache_bytes, take_rows  # noqa: F401
from jaxformer.model import Transformer, unstack_layers
from jaxformer.schemes import POSITION_SCHEMES


class Generated(NamedTuple):
    tokens: jax.Array    # int32 [batch, max_new_tokens]; pad_id after a row's EOS
    logprobs: jax.Array  # float32 [batch, max_new_tokens]: log p(token) under the model
    lengths: jax.Array   # int32 [batch]: tokens generated, the EOS included


class Beams(NamedTuple):
    tokens: jax.Array    # int32 [batch, max_new_tokens], the best beam of each row
    scores: jax.Array    # float32 [batch]: sum of log-probs / length ** length_penalty
    lengths: jax.Array   # int32 [batch]


# ---- sampling -----------------------------------------------------------------------

def filter_logits(logits, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None):
    """The logits sampling draws from: divided by the temperature, then only the top_k
    largest kept, then only the smallest set whose probability reaches top_p. Removed
    entries are -inf. logits: [..., V] float32.

    top_p: a token stays when the probability of the tokens ranked above it is below
    top_p, so the most likely token always stays and a token for which it equals top_p
    exactly goes (the rule of transformers' TopPLogitsWarper). Tokens tied with the last
    one kept all stay, as with top_k (HF's top-p keeps only the part of a tie that its sort
    puts first)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        desc = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        threshold = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample_logits(rng, logits, *, temperature: float = 1.0, top_k=None, top_p=None):
    """One token per row of logits [B, V]; temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


# ---- generate -----------------------------------------------------------------------

def _concrete(x):
    """x as a NumPy array, or None when it is traced (under jit/vmap: checked at trace time
    only for its shape)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _inputs(cfg: ModelConfig, prompts, prompt_lengths, max_new_tokens: int):
    """Validated (prompts int32 [B, W], lengths int32 [B]); errors name the bad input."""
    if not isinstance(prompts, jax.Array):
        prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be [batch, width] with width >= 1, got shape "
                         f"{prompts.shape}")
    b, width = prompts.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if width + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} = "
                         f"{width + max_new_tokens} exceeds max_seq_len={cfg.max_seq_len}; "
                         "shorten one of them")
    ids = _concrete(prompts)
    if ids is not None and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}); got "
                         f"min {ids.min()}, max {ids.max()}")
    if prompt_lengths is None:
        return jnp.asarray(prompts, jnp.int32), jnp.full((b,), width, jnp.int32)
    lengths = _concrete(prompt_lengths)
    if lengths is not None and (lengths.shape != (b,) or lengths.min() < 1 or
                                lengths.max() > width):
        raise ValueError(f"prompt_lengths must be {b} values in [1, {width}], got "
                         f"{lengths.tolist()}")
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)


def _prefill(model, params, prompts, lengths, max_len, cache_dtype, windowed):
    """Fill the cache (windowed: rings for windowed layers) with the prompts (padding
    marked empty); logits of each row's last real token [B, V]."""
    b, w = prompts.shape
    cache = init_cache(model.cfg, b, max_len, cache_dtype, windowed=windowed)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    real = (positions < lengths[:, None]).astype(jnp.int32)  # segment id 0 = padding
    logits, cache = model.apply({"params": params}, prompts, positions, real, cache=cache)
    return logits[jnp.arange(b), lengths - 1], cache


def _forward_one(model, params, tokens, positions, cache):
    """tokens, positions [B] -> logits [B, V], cache."""
    logits, cache = model.apply({"params": params}, tokens[:, None], positions[:, None],
                                cache=cache)
    return logits[:, 0], cache


def _looped(cfg: ModelConfig):
    """The model decoding runs, and a map to its params from the caller's: scanned layers
    run as a Python loop over unstacked params, since inside the decode loop nn.scan slices
    every layer's params and cache out of the stacked arrays on every step (4-6x slower)."""
    if not cfg.scan_layers:
        return Transformer(cfg), lambda params: params
    return Transformer(cfg.replace(scan_layers=False)), unstack_layers


@functools.lru_cache(maxsize=64)
def _generate_fn(cfg: ModelConfig, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
                 cache_dtype, windowed_cache=True):
    model, unstack = _looped(cfg)

    def run(params, prompts, lengths, rng):
        b, w = prompts.shape
        params = unstack(params)
        last, cache = _prefill(model, params, prompts, lengths, w + max_new_tokens, cache_dtype,
                               windowed_cache)

        def emit(logits, rng, done):
            tok = sample_logits(rng, logits, temperature=temperature, top_k=top_k, top_p=top_p)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0]
            tok = jnp.where(done, pad_id, tok)
            logp = jnp.where(done, 0.0, logp)
            now_done = done | (tok == eos_id) if eos_id is not None else done
            return tok, logp, now_done

        rng, first = jax.random.split(rng)
        tok, logp, done = emit(last, first, jnp.zeros((b,), bool))
        count = jnp.ones((b,), jnp.int32)

        def step(carry, key):
            cache, tok, pos, done, count = carry
            logits, cache = _forward_one(model, params, tok, pos, cache)
            new_tok, new_logp, new_done = emit(logits, key, done)
            count = count + (~done).astype(jnp.int32)
            return (cache, new_tok, pos + 1, new_done, count), (new_tok, new_logp)

        keys = jax.random.split(rng, max_new_tokens - 1)
        carry = (cache, tok, lengths, done, count)
        (_, _, _, _, count), (toks, logps) = jax.lax.scan(step, carry, keys)
        tokens = jnp.concatenate([tok[:, None], toks.T], axis=1)
        logprobs = jnp.concatenate([logp[:, None], logps.T], axis=1)
        return Generated(tokens, logprobs, count)

    return jax.jit(run)


def generate(model: Transformer, params, prompts, *, prompt_lengths=None,
             max_new_tokens: int, rng, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_id: int | None = None, pad_id: int = 0,
             cache_dtype=None, windowed_cache: bool = True, hooks=None) -> Generated:
    """Continue each row of `prompts` [batch, width] (right-padded; `prompt_lengths` [batch]
    gives the real lengths, None = all full) by `max_new_tokens` tokens.

    temperature=0 is greedy; top_k / top_p / temperature combine. After `eos_id` a row
    emits `pad_id` and its length stops growing. `logprobs` are log p(token) under the
    model's unmodified distribution. Compiles once per (config, shapes, settings); jittable
    and vmappable. cache_dtype: the KV cache's dtype (default the compute dtype; bf16 halves
    its memory). windowed_cache: a layer whose sliding window is shorter than the
    sequence keeps only a window of slots (a ring: jaxformer.kv_cache), e.g. Gemma 3's
    local layers; False keeps every layer at full length (always, for a contextual
    scheme: CoPE counts keys in row order, which a ring does not keep). hooks: {name: fn} as
    jaxformer.inspect.run_with_hooks takes them, applied through the KV-cached path: to the prompt's values in the prefill, then to each new
    token's (e.g. a steering vector added to `blocks.1.hook_resid_post` at every step).
    Attention patterns and scores are not computed there, so they cannot be hooked.
    """
    cfg = model.cfg
    prompts, lengths = _inputs(cfg, prompts, prompt_lengths, max_new_tokens)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={cfg.vocab_size}], got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    settings = (cfg, max_new_tokens, float(temperature), top_k,
                None if top_p is None else float(top_p), eos_id, pad_id,
                None if cache_dtype is None else jnp.dtype(cache_dtype).name,
                bool(windowed_cache) and POSITION_SCHEMES[cfg.position].logits is None)
    if not hooks:
        return _generate_fn(*settings)(params, prompts, lengths, rng)
    patterns = sorted(n for n in hooks if n.endswith(("hook_attn_scores", "hook_pattern")))
    if patterns:
        raise ValueError(f"generate cannot hook {', '.join(patterns)}: the KV-cached path "
                         "computes no attention pattern; hook attn.hook_z or the residual "
                         "stream, or use jaxformer.inspect.run_with_hooks on the full sequence")
    with session(hooks, lambda _: False):  # traced (and checked) inside, compiled afresh
        return _generate_fn.__wrapped__(*settings)(params, prompts, lengths, rng)


# ---- beam search --------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _beam_fn(cfg: ModelConfig, beam_width, max_new_tokens, length_penalty, eos_id, pad_id):
    model, unstack = _looped(cfg)
    k = beam_width

    def run(params, prompts, lengths):
        b, w = prompts.shape
        params = unstack(params)
        last, cache = _prefill(model, params, prompts, lengths, w + max_new_tokens, None, True)
        v = last.shape[-1]
        # every beam starts as a copy of its row; only beam 0 is live at first
        cache = take_rows(cache, jnp.repeat(jnp.arange(b), k), cfg.n_kv_heads)  # B * k rows
        logits = jnp.repeat(last, k, axis=0)  # [B*k, V]
        scores = jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (b, 1))  # [B, k]
        state = dict(cache=cache, logits=logits, scores=scores,
                     tokens=jnp.full((b, k, max_new_tokens), pad_id, jnp.int32),
                     done=jnp.zeros((b, k), bool), length=jnp.zeros((b, k), jnp.int32),
                     pos=jnp.repeat(lengths, k))

        def step(state, t):
            logp = jax.nn.log_softmax(state["logits"]).reshape(b, k, v)
            # a finished beam continues only with pad, at no cost
            pad_only = jnp.where(jnp.arange(v) == pad_id, 0.0, -jnp.inf)
            logp = jnp.where(state["done"][..., None], pad_only, logp)
            cand = (state["scores"][..., None] + logp).reshape(b, k * v)
            scores, idx = jax.lax.top_k(cand, k)  # [B, k]
            parent, tok = idx // v, (idx % v).astype(jnp.int32)
            take = lambda x: jnp.take_along_axis(x, parent.reshape(b, k, *([1] * (x.ndim - 2))),  # noqa: E731
                                                 axis=1)
            was_done = take(state["done"])
            tokens = take(state["tokens"]).at[:, :, t].set(tok)
            length = take(state["length"]) + (~was_done).astype(jnp.int32)
            done = was_done | (tok == eos_id) if eos_id is not None else was_done
            flat_parent = (parent + jnp.arange(b)[:, None] * k).reshape(-1)  # [B*k]
            cache = take_rows(state["cache"], flat_parent, cfg.n_kv_heads)
            pos = jnp.take(state["pos"], flat_parent)
            logits, cache = _forward_one(model, params, tok.reshape(-1), pos, cache)
            return dict(cache=cache, logits=logits, scores=scores, tokens=tokens, done=done,
                        length=length, pos=pos + 1), None

        state, _ = jax.lax.scan(step, state, jnp.arange(max_new_tokens))
        normed = state["scores"] / jnp.maximum(state["length"], 1) ** length_penalty
        best = jnp.argmax(normed, axis=1)  # [B]
        pick = lambda x: jnp.take_along_axis(x, best.reshape(b, 1, *([1] * (x.ndim - 2))),  # noqa: E731
                                             axis=1)[:, 0]
        return Beams(pick(state["tokens"]), pick(normed), pick(state["length"]))

    return jax.jit(run)


def beam_search(model: Transformer, params, prompts, *, beam_width: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
                prompt_lengths=None) -> Beams:
    """The best of `beam_width` beams per row, by sum of log-probs / length**length_penalty
    (length_penalty 0: the plain sum). Beams that emit `eos_id` stop and keep their score."""
    cfg = model.cfg
    prompts, lengths = _inputs(cfg, prompts, prompt_lengths, max_new_tokens)
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    fn = _beam_fn(cfg, beam_width, max_new_tokens, float(length_penalty), eos_id, pad_id)
    return fn(params, prompts, lengths)
