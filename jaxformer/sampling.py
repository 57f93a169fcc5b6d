"""Sampling from logits: the filters (temperature, top-k, top-p), one draw per row, and the
accept / resample rule that makes speculative decoding exact (Leviathan et al. 2023,
Chen et al. 2023)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    """One token per row of logits [..., V]; temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def accept_drafts(rng, logits, drafts, draft_logits=None, *, temperature: float = 1.0,
                  top_k=None, top_p=None):
    """How many of k drafted tokens the target keeps, and the tokens it emits.

    logits [k + 1, V]: the target's, after the last emitted token and after each draft;
    drafts [k]; draft_logits [k, V]: the draft's for each of them (None: a deterministic
    draft such as prompt lookup, q = one-hot). Returns (a, tokens [k + 1]): drafts
    0..a-1 kept and tokens[a] the target's own next one; tokens[:a] == drafts[:a].

    temperature 0: the drafts that equal the target's argmax, then its argmax. Else draft i
    stays with probability min(1, p_i(d) / q_i(d)) (p, q the filtered distributions); the
    first one refused is replaced by a draw from max(0, p_i - q_i), renormalised; when all
    stay, a draw from p_k. The emitted tokens then follow p exactly, whatever q is."""
    k = drafts.shape[0]
    if temperature == 0:
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [k + 1]
        return jnp.sum(jnp.cumprod(drafts == best[:k])), best
    sample = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    p = jax.nn.softmax(filter_logits(logits, **sample), axis=-1)  # [k + 1, V]
    q = (jax.nn.one_hot(drafts, p.shape[-1]) if draft_logits is None
         else jax.nn.softmax(filter_logits(draft_logits, **sample), axis=-1))  # [k, V]
    u_key, r_key = jax.random.split(rng)
    rows = jnp.arange(k)
    stays = jax.random.uniform(u_key, (k,)) * q[rows, drafts] < p[rows, drafts]
    a = jnp.sum(jnp.cumprod(stays))
    residual = jnp.concatenate([jnp.maximum(p[:k] - q, 0.0), p[k:]])[a]  # [V]
    residual = jnp.where(residual.sum() > 0, residual, p[a])  # (p == q: never refused)
    new = jax.random.categorical(r_key, jnp.log(residual)).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(k + 1) < a, jnp.append(drafts, 0), new)
    return a, tokens
