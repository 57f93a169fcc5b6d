"""Beam search with a KV cache: k beams per row, each a row of the cache; at each step the
k best of all (beam, next token) extensions survive, and every beam's state (its cache
rows, tokens, length, position, history) follows the beam it extends (BeamState.reordered).
The loop (beam_loop) serves any model with a KV cache: a decoder (beam_search here) or an
encoder-decoder (jaxformer.decode.seq2seq)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.attention.cache_formats import cache_format_name
from jaxformer.attention.kv_cache import cache_widths, take_rows
from jaxformer.decode.cached_forward import checked_inputs, decode_jit, forward_one, looped, prefill
from jaxformer.decode.constraints import (Constraints, checked_constraints, constrain,
                                          prompt_history, recorded)
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import Transformer


class Beams(NamedTuple):
    tokens: jax.Array    # int32 [batch, max_new_tokens], the best beam of each row
    scores: jax.Array    # float32 [batch]: sum of log-probs / length ** length_penalty
    lengths: jax.Array   # int32 [batch]


class BeamState(NamedTuple):
    """The scan's carry: B rows of k beams; beam j of row b is cache row b * k + j."""
    cache: dict               # the KV cache of B * k rows (each n_kv K/V rows)
    logits: jax.Array         # float32 [B * k, V]: the logits of each beam's next token
    scores: jax.Array         # float32 [B, k]: sum of log-probs; -inf: no beam (yet)
    tokens: jax.Array         # int32 [B, k, max_new_tokens]: pad_id where none yet
    done: jax.Array           # bool [B, k]: the beam has emitted eos_id
    length: jax.Array         # int32 [B, k]: tokens emitted, the EOS included (no pad)
    pos: jax.Array            # int32 [B * k]: the position of the beam's next token
    history: jax.Array | None  # int32 [B * k, L]: the tokens a constraint reads, or None

    def reordered(self, parent, n_kv: int) -> BeamState:
        """Beam j of row b taken from beam parent[b, j] ([B, k]) of the same row: every
        field's rows (the cache's K/V rows too) follow their beam."""
        b, k = parent.shape
        flat = (parent + jnp.arange(b)[:, None] * k).reshape(-1)  # [B * k]
        per_row = lambda x: jnp.take_along_axis(  # noqa: E731  [B, k, ...]
            x, parent.reshape(b, k, *([1] * (x.ndim - 2))), axis=1)
        flat_rows = lambda x: jnp.take(x, flat, axis=0)  # noqa: E731  [B * k, ...]
        return BeamState(cache=take_rows(self.cache, flat, n_kv), logits=flat_rows(self.logits),
                         scores=per_row(self.scores), tokens=per_row(self.tokens),
                         done=per_row(self.done), length=per_row(self.length),
                         pos=flat_rows(self.pos), history=jax.tree.map(flat_rows, self.history))


def initial_state(last, cache, pos, k: int, max_new_tokens: int, pad_id: int, n_kv: int,
                  history=None) -> BeamState:
    """k copies of each row of `last` [B, V], cache (B rows), pos [B] and history [B, L];
    only beam 0 is live (the others' scores -inf)."""
    b = last.shape[0]
    return BeamState(cache=take_rows(cache, jnp.repeat(jnp.arange(b), k), n_kv),
                     logits=jnp.repeat(last, k, axis=0),
                     scores=jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (b, 1)),
                     tokens=jnp.full((b, k, max_new_tokens), pad_id, jnp.int32),
                     done=jnp.zeros((b, k), bool), length=jnp.zeros((b, k), jnp.int32),
                     pos=jnp.repeat(pos, k),
                     history=jax.tree.map(lambda h: jnp.repeat(h, k, axis=0), history))


def beam_loop(forward, last, cache, pos, *, beam_width, max_new_tokens, eos_id, pad_id,
              n_kv: int, normalise, constraints=Constraints(), history=None):
    """Beam search from `last` [B, V] and a cache of B rows (each n_kv K/V rows), each beam
    fed back through forward(tokens [B * k], positions [B * k], cache) -> (logits, cache)
    at positions pos [B], pos + 1, ...; the best beam per row by normalise(sum of
    log-probs, length) -> Beams. A beam that emits eos_id stops (then pad only, at no cost).
    Each step's log-probs are constrained (jaxformer.decode.constraints) before the choice;
    history [B, L]: as loops.sample_loop's."""
    b, v = last.shape
    k = beam_width
    state = initial_state(last, cache, pos, k, max_new_tokens, pad_id, n_kv, history)
    pad_only = jnp.where(jnp.arange(v) == pad_id, 0.0, -jnp.inf)  # a finished beam's step

    def step(state: BeamState, t):
        logp = constrain(jax.nn.log_softmax(state.logits), constraints, t, max_new_tokens,
                         eos_id, state.history, state.pos).reshape(b, k, v)
        logp = jnp.where(state.done[..., None], pad_only, logp)
        scores, idx = jax.lax.top_k((state.scores[..., None] + logp).reshape(b, k * v), k)
        parent, tok = idx // v, (idx % v).astype(jnp.int32)  # [B, k]
        kept = state.reordered(parent, n_kv)
        done = kept.done | (tok == eos_id) if eos_id is not None else kept.done
        logits, cache = forward(tok.reshape(-1), kept.pos, kept.cache)
        return BeamState(cache=cache, logits=logits, scores=scores,
                         tokens=kept.tokens.at[:, :, t].set(tok), done=done,
                         length=kept.length + (~kept.done).astype(jnp.int32), pos=kept.pos + 1,
                         history=recorded(kept.history, kept.pos, tok.reshape(-1))), None

    state, _ = jax.lax.scan(step, state, jnp.arange(max_new_tokens))
    normed = normalise(state.scores, state.length)
    best = jnp.argmax(normed, axis=1)  # [B]
    pick = lambda x: jnp.take_along_axis(x, best.reshape(b, 1, *([1] * (x.ndim - 2))),  # noqa: E731
                                         axis=1)[:, 0]
    return Beams(pick(state.tokens), pick(normed), pick(state.length))


@functools.lru_cache(maxsize=16)
def _beam_fn(cfg: ModelConfig, beam_width, max_new_tokens, length_penalty, eos_id, pad_id,
             constraints, cache_dtype=None):
    model, unstack = looped(cfg)

    def run(params, prompts, lengths):
        params = unstack(params)
        last, cache = prefill(model, params, prompts, lengths, prompts.shape[1] + max_new_tokens,
                              cache_dtype, True)
        forward = lambda tok, pos, cache: forward_one(model, params, tok, pos, cache)  # noqa: E731
        history = prompt_history(prompts, max_new_tokens, constraints)
        return beam_loop(forward, last, cache, lengths, beam_width=beam_width,
                         max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                         n_kv=cache_widths(cfg)[0],
                         normalise=lambda s, n: s / jnp.maximum(n, 1) ** length_penalty,
                         constraints=constraints, history=history)

    return decode_jit(run)


def beam_search(model: Transformer, params, prompts, *, beam_width: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
                prompt_lengths=None, constraints: Constraints | None = None,
                cache_dtype=None) -> Beams:
    """The best of `beam_width` beams per row, by sum of log-probs / length**length_penalty
    (length_penalty 0: the plain sum). Beams that emit `eos_id` stop and keep their score.
    constraints, cache_dtype (the KV cache's format, int8 among them: its entries' values
    and scales follow their beams): as jaxformer.decode.loops.generate's."""
    cfg = model.cfg
    cache = None if cache_dtype is None else cache_format_name(cache_dtype)
    prompts, lengths = checked_inputs(cfg, prompts, prompt_lengths, max_new_tokens,
                                      eos_id=eos_id, pad_id=pad_id)
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    fn = _beam_fn(cfg, beam_width, max_new_tokens, float(length_penalty), eos_id, pad_id,
                  checked_constraints(constraints, cfg.vocab_size, eos_id), cache)
    return fn(params, prompts, lengths)
