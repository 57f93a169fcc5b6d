"""KV-cached decoding: one prefill forward over the prompt batch, then a fixed-length
jax.lax.scan of single-token steps; greedy, temperature, top-k, top-p and min-p; with a
draft, speculative decoding (jaxformer.decode.speculative). Beam search: jaxformer.decode.beam
(its names are imported here too).

The sampling settings are values (jaxformer.decode.sampling.Sampling, traced): one compiled
decoder serves every temperature and filter, per row if need be. What changes shapes
(max_new_tokens, the cache's length and dtype) and eos_id / pad_id compile their own.

The cache (its layout, writes and reads: jaxformer.attention.kv_cache) is an explicit pytree
updated in place; every row writes its next token into the same slot, so rows with
prompts of different lengths decode together, each at its own positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.attention.cache_formats import cache_format_name
from jaxformer.attention.kv_cache import init_cache, kv_cache_bytes  # noqa: F401
from jaxformer.core.hooks import refuse_pattern_hooks, session
from jaxformer.core.logprobs import target_logprobs
from jaxformer.decode.beam import Beams, beam_loop, beam_search  # noqa: F401 (their old home)
from jaxformer.decode.cached_forward import (Generated, checked_inputs, decode_jit, forward_one,
                                             looped, prefill)
from jaxformer.decode.constraints import (Constraints, checked_constraints, constrain,
                                          prompt_history, recorded)
from jaxformer.decode.sampling import (Sampling, checked_sampling, filter_logits,  # noqa: F401
                                       sample_logits)
from jaxformer.decode.speculative import checked_draft, speculative_fn
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import Transformer
from jaxformer.positions.schemes import POSITION_SCHEMES


def sample_loop(forward, last, cache, pos, rng, sampling, max_new_tokens, eos_id, pad_id,
                constraints=Constraints(), history=None):
    """Tokens sampled from `last` [B, V] on, each fed back through forward(tokens [B],
    positions [B], cache) -> (logits [B, V], cache) at positions pos, pos + 1, ... [B]:
    the decoding loop of generate, for any model with a KV cache -> Generated. Sampled
    under `constraints` (jaxformer.decode.constraints); history [B, L]: each row's tokens before
    pos (what constraints.needs_history asks for), the new ones written after them."""
    b = last.shape[0]

    def emit(logits, rng, done, step, pos, history):
        allowed = constrain(logits, constraints, step, max_new_tokens, eos_id, history, pos)
        tok = sample_logits(rng, allowed, sampling)
        logp = target_logprobs(logits, tok)  # the training loss's log-softmax
        tok = jnp.where(done, pad_id, tok)
        logp = jnp.where(done, 0.0, logp)
        now_done = done | (tok == eos_id) if eos_id is not None else done
        return tok, logp, now_done, recorded(history, pos, tok)

    rng, first = jax.random.split(rng)
    tok, logp, done, history = emit(last, first, jnp.zeros((b,), bool), 0, pos, history)
    count = jnp.ones((b,), jnp.int32)

    def step(carry, xs):
        cache, tok, pos, done, count, history = carry
        key, t = xs
        logits, cache = forward(tok, pos, cache)
        new_tok, new_logp, new_done, history = emit(logits, key, done, t, pos + 1, history)
        count = count + (~done).astype(jnp.int32)
        return (cache, new_tok, pos + 1, new_done, count, history), (new_tok, new_logp)

    xs = (jax.random.split(rng, max_new_tokens - 1), jnp.arange(1, max_new_tokens))
    carry, (toks, logps) = jax.lax.scan(step, (cache, tok, pos, done, count, history), xs)
    tokens = jnp.concatenate([tok[:, None], toks.T], axis=1)
    logprobs = jnp.concatenate([logp[:, None], logps.T], axis=1)
    return Generated(tokens, logprobs, carry[4])


def _decode_run(cfg: ModelConfig, max_new_tokens, eos_id, pad_id, cache_dtype, windowed_cache,
                constraints=Constraints()):
    """run(params, prompts, lengths, rng, sampling) -> Generated, to be jitted; sampling: a
    Sampling of [batch] arrays."""
    model, unstack = looped(cfg)

    def run(params, prompts, lengths, rng, sampling):
        params = unstack(params)
        last, cache = prefill(model, params, prompts, lengths, prompts.shape[1] + max_new_tokens,
                              cache_dtype, windowed_cache)
        forward = lambda tok, pos, cache: forward_one(model, params, tok, pos, cache)  # noqa: E731
        return sample_loop(forward, last, cache, lengths, rng, sampling, max_new_tokens, eos_id,
                           pad_id, constraints, prompt_history(prompts, max_new_tokens,
                                                               constraints))

    return run


@functools.lru_cache(maxsize=64)
def _decoder(cfg: ModelConfig, max_new_tokens, eos_id, pad_id, cache_dtype, windowed_cache,
             constraints=Constraints()):
    """The jitted decoder of these static settings: run(params, prompts, lengths, rng,
    sampling), compiled once per shape."""
    return decode_jit(_decode_run(cfg, max_new_tokens, eos_id, pad_id, cache_dtype,
                                  windowed_cache, constraints))


def _windowed(cfg: ModelConfig, windowed_cache: bool) -> bool:
    """Whether cfg's windowed layers keep rings: never for a contextual scheme (CoPE
    counts keys in row order, which a ring does not keep)."""
    return bool(windowed_cache) and POSITION_SCHEMES[cfg.position].logits is None


def _sampling_of(sampling: Sampling | None, keywords: dict, batch: int, vocab_size: int):
    """generate's Sampling, [batch] arrays: `sampling`, or one of the keywords."""
    if sampling is None:
        return checked_sampling(Sampling(**keywords), batch, vocab_size)
    if keywords != {"temperature": 1.0, **{n: None for n in keywords if n != "temperature"}}:
        raise ValueError("pass sampling=Sampling(...) or temperature / top_k / top_p / "
                         f"min_p, not both (got {keywords})")
    return checked_sampling(sampling, batch, vocab_size)


def generate(model: Transformer, params, prompts, *, prompt_lengths=None,
             max_new_tokens: int, rng, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             sampling: Sampling | None = None, eos_id: int | None = None, pad_id: int = 0,
             cache_dtype=None, windowed_cache: bool = True, hooks=None, draft=None,
             draft_len: int = 4, constraints: Constraints | None = None) -> Generated:
    """Continue each row of `prompts` [batch, width] (right-padded; `prompt_lengths` [batch]
    gives the real lengths, None = all full) by `max_new_tokens` tokens.

    temperature=0 is greedy; top_k / top_p / min_p / temperature combine (None: off), each
    one value or one per row [batch]; or pass them together as `sampling=Sampling(...)`
    (jaxformer.decode.sampling). They are values: a new setting runs the same compiled decoder.
    After `eos_id` a row emits `pad_id` and its length stops growing. `logprobs` are log
    p(token) under the model's unmodified distribution. Compiles once per (config, shapes,
    eos_id, pad_id); jittable and vmappable. cache_dtype: the KV cache's format (default
    the compute dtype): float32, bfloat16, float16 or int8 (a float32 scale per token and
    K/V head: 1/2 + 2/head_dim of bf16's bytes; jaxformer.attention.cache_formats).
    windowed_cache: a layer whose sliding window is shorter than the sequence keeps only a window
    of slots (a ring: jaxformer.attention.kv_cache), e.g. Gemma 3's local layers; False keeps
    every layer at full length (always, for a contextual scheme: CoPE counts keys in row order,
    which a ring does not keep). hooks: {name: fn} as jaxformer.model.inspect.run_with_hooks takes
    them, applied through the KV-cached path: to the prompt's values in the prefill, then to each
    new token's (e.g. a steering vector added to `blocks.1.hook_resid_post` at every step).
    Attention patterns and scores are not computed there, so they cannot be hooked. A mixture of
    experts decodes dropless (cached_forward.decoding_config: capacity_factor trains).

    draft: speculative decoding (jaxformer.decode.speculative), the same output distribution
    (greedy: the same tokens) in fewer forwards of the model: `(draft_model,
    draft_params)`, a smaller model with the same vocabulary, or a proposer's name
    (jaxformer.decode.speculative.PROPOSERS: prompt_lookup); each round it proposes `draft_len`
    tokens. The result's `drafted` / `accepted` count them (`acceptance_rate`); prompt
    width + max_new_tokens + draft_len must fit max_seq_len.

    constraints: jaxformer.decode.constraints.Constraints (min_new_tokens, no_repeat_ngram_size,
    forced_bos_id, forced_eos_id), as transformers' generate applies them; None: none.
    """
    cfg = model.cfg
    keywords = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    cache = None if cache_dtype is None else cache_format_name(cache_dtype)
    constraints = checked_constraints(constraints, cfg.vocab_size, eos_id)
    if draft is not None:
        for refused, what in ((hooks, "hook"), (constraints != Constraints(), "constrain")):
            if refused:  # the model runs on drafts it may refuse
                raise ValueError(f"generate cannot {what} a speculative decode; pass "
                                 f"draft=None to {what} generation")
        proposer, dcfg, dparams = checked_draft(cfg, draft, draft_len)
        prompts, lengths = checked_inputs(cfg, prompts, prompt_lengths, max_new_tokens,
                                          room=draft_len, eos_id=eos_id, pad_id=pad_id)
        windowed = (_windowed(cfg, windowed_cache), dcfg and _windowed(dcfg, windowed_cache))
        fn = speculative_fn(cfg, proposer, dcfg, draft_len, max_new_tokens, eos_id, pad_id,
                            cache, windowed)
        return fn(params, dparams, prompts, lengths, rng,
                  _sampling_of(sampling, keywords, prompts.shape[0], cfg.vocab_size))
    prompts, lengths = checked_inputs(cfg, prompts, prompt_lengths, max_new_tokens,
                                      eos_id=eos_id, pad_id=pad_id)
    args = (params, prompts, lengths, rng,
            _sampling_of(sampling, keywords, prompts.shape[0], cfg.vocab_size))
    settings = (cfg, max_new_tokens, eos_id, pad_id, cache, _windowed(cfg, windowed_cache),
                constraints)
    return _decoder(*settings)(*args) if not hooks else _hooked(hooks, settings, args)


def _hooked(hooks: dict, settings: tuple, args: tuple) -> Generated:
    """generate's decode with `hooks` applied (traced inside, compiled afresh)."""
    refuse_pattern_hooks(hooks, "generate")
    with session(hooks, lambda _: False):
        return decode_jit(_decode_run(*settings))(*args)
