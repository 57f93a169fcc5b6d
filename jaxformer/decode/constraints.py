"""What a decoder may emit, beyond the model's distribution: the constraints transformers'
generate applies as logits processors of the same meaning (MinNewTokensLength,
NoRepeatNGram, ForcedBOSToken, ForcedEOSToken), e.g. BART's summarisers'.

    Constraints(min_new_tokens=0, no_repeat_ngram_size=0, forced_bos_id=None,
                forced_eos_id=None)

Each step's log-probabilities (or logits) are constrained before greedy, sampling or a
beam's choice: a banned token gets -inf; a forced token 0 and every other -inf (as
transformers', so a beam's score does not count a forced token's log-probability). The
log-probabilities generate returns stay the model's own. Static settings: each
combination compiles its own decoder.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class Constraints(NamedTuple):
    min_new_tokens: int = 0        # eos_id is banned until this many new tokens
    no_repeat_ngram_size: int = 0  # n > 0: no n-gram occurs twice in a row's sequence,
    #                                the prompt (an encoder-decoder's: the BOS) included
    forced_bos_id: int | None = None  # the first new token
    forced_eos_id: int | None = None  # the last one (at max_new_tokens), unless ended before

    @property
    def needs_history(self) -> bool:
        """Whether the decoder must keep each row's tokens (for the n-gram ban)."""
        return self.no_repeat_ngram_size > 0


def checked_constraints(constraints: Constraints | None, vocab_size: int,
                        eos_id: int | None) -> Constraints:
    """constraints (None: none) validated: ids within the vocabulary, sizes >= 0, and an
    eos_id for min_new_tokens to ban."""
    c = Constraints() if constraints is None else Constraints(*constraints)
    for name in ("min_new_tokens", "no_repeat_ngram_size"):
        if int(getattr(c, name)) < 0:
            raise ValueError(f"Constraints.{name} must be >= 0, got {getattr(c, name)}")
    for name in ("forced_bos_id", "forced_eos_id"):
        value = getattr(c, name)
        if value is not None and not 0 <= int(value) < vocab_size:
            raise ValueError(f"Constraints.{name}={value} is outside the vocabulary "
                             f"[0, {vocab_size}); pass an id below {vocab_size} or None")
    if c.min_new_tokens and eos_id is None:
        raise ValueError(f"Constraints.min_new_tokens={c.min_new_tokens} bans eos_id, but "
                         "eos_id is None; pass eos_id (or min_new_tokens=0)")
    return c


def prompt_history(prompts, max_new_tokens: int, constraints: Constraints):
    """The tokens a constraint reads (each row's prompt, room for the new ones), or None."""
    return jnp.pad(prompts, ((0, 0), (0, max_new_tokens))) if constraints.needs_history \
        else None


def recorded(history, position, tokens):
    """history [B, L] (None: none kept) with tokens [B] written at position [B]."""
    if history is None:
        return None
    return history.at[jnp.arange(history.shape[0]), position].set(tokens, mode="drop")


def ngram_bans(history, position, n: int, vocab_size: int):
    """bool [B, V]: the tokens that would complete, at `position` [B], an n-gram that
    history [B, L] (each row's tokens at positions 0 .. position - 1) already holds."""
    b, length = history.shape
    if length < n:
        return jnp.zeros((b, vocab_size), bool)
    last = jnp.take_along_axis(history, jnp.maximum(position[:, None] - n + 1
                                                    + jnp.arange(n - 1), 0), axis=1)
    windows = jnp.stack([history[:, i:length - n + 1 + i] for i in range(n)], -1)  # [B, J, n]
    ends = jnp.arange(length - n + 1) + n - 1  # each window's last position
    match = jnp.all(windows[..., :-1] == last[:, None, :], -1) & (ends < position[:, None])
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, vocab_size), bool).at[rows, windows[..., -1]].max(match)


def constrain(scores, c: Constraints, step, max_new_tokens: int, eos_id: int | None,
              history=None, position=None):
    """scores [B, V] (logits or log-probs) of new token `step` (0-based, a scalar) under
    c; history [B, L] and position [B] as ngram_bans takes them (needed when
    c.needs_history)."""
    vocab = jnp.arange(scores.shape[-1])
    if c.min_new_tokens:
        scores = jnp.where((vocab == eos_id) & (step < c.min_new_tokens), -jnp.inf, scores)
    if c.no_repeat_ngram_size:
        bans = ngram_bans(history, position, c.no_repeat_ngram_size, scores.shape[-1])
        scores = jnp.where(bans, -jnp.inf, scores)
    for forced, when in ((c.forced_bos_id, step == 0),
                         (c.forced_eos_id, step == max_new_tokens - 1)):
        if forced is not None:
            scores = jnp.where(when, jnp.where(vocab == forced, 0.0, -jnp.inf), scores)
    return scores
