"""Sampling from logits: how a token is drawn (a Sampling value: the temperature and the
filters, as arrays, so that a new setting is a new argument to the same compiled program,
not a new program), one draw per row, and the accept / resample rule that makes
speculative decoding exact (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Sampling(NamedTuple):
    """How each token is drawn, as values: each field one value or one per row [batch],
    traced under jit (a pytree). temperature 0 is greedy (argmax); a filter at its off
    value (FILTERS; None means it too) keeps every token. The filters apply in this order,
    after the temperature (transformers' order)."""
    temperature: Any = 1.0
    top_k: Any = 0      # keep the top_k largest logits, and any tied with the last
    top_p: Any = 1.0    # keep the fewest most likely tokens whose probability reaches top_p
    min_p: Any = 0.0    # keep the tokens at least min_p times as likely as the likeliest


def ordered_keys(z):
    """int32 keys of float32 values z in the same order (x < y iff key(x) < key(y)), so an
    exact search over the values runs on integers."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def value_of(key):
    """The float32 value of an ordered key (ordered_keys' inverse)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def least_value(z, holds):
    """The least value t [..., 1] of the row's own values z [..., V] (-inf: removed) for
    which holds(keys, t) is true, holds monotone in t (false below, true from it on) and
    true at the row's largest value: a bisection over the 32-bit keys (32 halvings, each a
    pass over the row; no sort: XLA:CPU sorts a [32, 2048] block in ~9 ms)."""
    keys = ordered_keys(z)
    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflow
        ok = holds(keys, mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (jnp.minimum(lo, hi), hi))
    return value_of(hi)


def top_k_floor(z, k):
    """The k-th largest logit of z [..., V] (ties with it stay): the least t with fewer
    than k logits above it; k [..., 1] = 0: off (-inf)."""
    floor = least_value(z, lambda keys, t: jnp.sum(keys > t, -1, keepdims=True) < k)
    return jnp.where(k > 0, floor, -jnp.inf)


def top_p_floor(z, top_p):
    """The lowest logit of the nucleus: a token stays when the probability of the tokens
    ranked above it is below top_p, so the most likely always stays and one for which it
    equals top_p exactly goes (transformers' TopPLogitsWarper), and ties stay whole (HF's
    keeps only the part of a tie its sort puts first): the least logit t with the mass of
    the logits above it below top_p; top_p = 1: off."""
    probs = jax.nn.softmax(z, axis=-1)
    floor = least_value(z, lambda keys, t: jnp.sum(
        jnp.where(keys > t, probs, 0.0), -1, keepdims=True) < top_p)
    return jnp.where(top_p < 1, floor, -jnp.inf)


def min_p_floor(z, min_p):
    """The lowest logit of a token with probability >= min_p * the largest probability
    (Nguyen et al. 2024; transformers' MinPLogitsWarper); min_p = 0: off."""
    probs = jax.nn.softmax(z, axis=-1)
    keep = probs >= min_p * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.min(jnp.where(keep, z, jnp.inf), axis=-1, keepdims=True)


class Filter(NamedTuple):
    """A filter of the logits, as the lowest logit it keeps (everything below it goes)."""
    floor: Callable    # (logits [..., V] (-inf: removed), value [..., 1]) -> lowest kept [..., 1]
    off: int | float   # the value that keeps every token (its type: the field's dtype)
    allowed: str       # the values it takes, in words (vocab: the vocabulary's size)
    valid: Callable    # (values: np.ndarray, vocab) -> bool array


# the filters, in the order they apply; each is a field of Sampling (a test checks it)
FILTERS = {
    "top_k": Filter(top_k_floor, 0, "an integer in [0, vocab_size={vocab}] (0: off)",
                    lambda k, vocab: (k == np.round(k)) & (0 <= k) & (k <= vocab)),
    "top_p": Filter(top_p_floor, 1.0, "in (0, 1] (1: off)", lambda p, vocab: (0 < p) & (p <= 1)),
    "min_p": Filter(min_p_floor, 0.0, "in [0, 1] (0: off)", lambda p, vocab: (0 <= p) & (p <= 1)),
}


def filter_values(sampling: Sampling) -> dict:
    """{filter name: its value}, None as the filter's off value."""
    return {name: f.off if getattr(sampling, name) is None else getattr(sampling, name)
            for name, f in FILTERS.items()}


def checked_sampling(sampling: Sampling, batch: int, vocab_size: int) -> Sampling:
    """sampling with every field an array [batch] (float32; top_k int32), so that all
    values run one compiled program. Values known here (not traced) are checked: errors
    name the field and what it takes."""
    rules = {"temperature": (1.0, ">= 0 (0: greedy)", lambda t, vocab: t >= 0),
             **{n: (f.off, f.allowed, f.valid) for n, f in FILTERS.items()}}
    values = {"temperature": sampling.temperature, **filter_values(sampling)}
    out = {}
    for name, (off, allowed, valid) in rules.items():
        value = values[name]
        if np.shape(value) not in ((), (batch,)):
            raise ValueError(f"{name} must be one value or {batch} (one per row), got shape "
                             f"{np.shape(value)}")
        if not isinstance(value, jax.core.Tracer) and not np.all(valid(np.asarray(value),
                                                                       vocab_size)):
            raise ValueError(f"{name} must be {allowed.format(vocab=vocab_size)}, got "
                             f"{np.asarray(value).tolist()}")
        xp = jnp if isinstance(value, jax.Array) else np  # (NumPy: no program to compile)
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(off).dtype)  # int32 or float32
        out[name] = jnp.asarray(xp.broadcast_to(xp.asarray(value, dtype), (batch,)))
    return Sampling(**out)


class Branches(NamedTuple):
    """Whether any row draws at all (a temperature above 0) and whether any filter is on,
    bool []: the lax.conds that skip the draw and the sort. Read from the whole batch's
    settings outside a vmap over rows (speculative decoding's): read inside it from one
    row's, a cond becomes a select that runs both sides."""
    draws: jax.Array
    filters: jax.Array


def branches_of(sampling: Sampling) -> Branches:
    """The Branches of these settings (all of a batch's, for its rows to share)."""
    on = [jnp.any(jnp.asarray(v) != FILTERS[n].off) for n, v in filter_values(sampling).items()]
    return Branches(jnp.any(jnp.asarray(sampling.temperature) != 0), jnp.any(jnp.stack(on)))


def given(sampling: Sampling | None, settings: dict) -> Sampling:
    """`sampling`, or a Sampling of the keywords (temperature=, top_k=, ...) given instead."""
    if sampling is None:
        return Sampling(**settings)
    if settings:
        raise TypeError(f"pass a Sampling or the keywords {', '.join(Sampling._fields)}, not "
                        f"both (got {', '.join(settings)})")
    return sampling


def filter_logits(logits, sampling: Sampling | None = None, branches: Branches | None = None,
                  **settings):
    """The logits sampling draws from, float32 [..., V]: divided by the temperature, then
    each filter in turn (each on what the ones before kept), removed entries -inf. The
    fields broadcast against logits' leading axes (one per row, or one). Each filter's
    floor is found by an exact search over the values (least_value); none runs with every
    filter off."""
    sampling = given(sampling, settings)  # (or the keywords: filter_logits(z, top_p=0.9))
    expand = lambda x: jnp.asarray(x)[..., None]  # noqa: E731
    t = expand(sampling.temperature)
    z = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)  # (0: greedy, no division)
    values = {name: expand(v) for name, v in filter_values(sampling).items()}

    def filtered(z):
        floor = jnp.full((*z.shape[:-1], 1), -jnp.inf)
        for name, f in FILTERS.items():  # each sees the logits the ones before kept
            floor = jnp.maximum(floor, f.floor(jnp.where(z < floor, -jnp.inf, z),
                                               values[name]))
        return jnp.where(z < floor, -jnp.inf, z)

    branches = branches_of(sampling) if branches is None else branches
    return jax.lax.cond(branches.filters, filtered, lambda z: z, z)


def sample_logits(rng, logits, sampling: Sampling | None = None,
                  branches: Branches | None = None, **settings):
    """One token per row of logits [..., V]: drawn from filter_logits', or, where the
    temperature is 0, the argmax (greedy: no draw is made when every row is greedy).
    The settings as a Sampling, or as its keywords."""
    return sample_and_filter(rng, logits, given(sampling, settings), branches)[0]


def sample_and_filter(rng, logits, sampling: Sampling, branches: Branches | None = None):
    """(sample_logits' token, the filtered logits it was drawn from: logits as they are
    where every row is greedy)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    branches = branches_of(sampling) if branches is None else branches

    def draw():
        z = filter_logits(logits, sampling, branches)
        return jax.random.categorical(rng, z, axis=-1).astype(jnp.int32), z

    drawn, z = jax.lax.cond(branches.draws, draw,
                            lambda: (greedy, logits.astype(jnp.float32)))
    return jnp.where(jnp.asarray(sampling.temperature) == 0, greedy, drawn), z


def accept_drafts(rng, logits, drafts, draft_probs, sampling: Sampling,
                  branches: Branches | None = None):
    """How many of k drafted tokens the target keeps, and the tokens it emits.

    logits [k + 1, V]: the target's, after the last emitted token and after each draft;
    drafts [k]; draft_probs [k, V]: the distribution each was drawn from (one-hot for a
    deterministic draft such as prompt lookup); sampling: this row's (scalars). Returns
    (a, tokens [k + 1]): drafts 0..a-1 kept and tokens[a] the target's own next one;
    tokens[:a] == drafts[:a].

    temperature 0: the drafts that equal the target's argmax, then its argmax. Else draft i
    stays with probability min(1, p_i(d) / q_i(d)) (p the filtered distribution, q the
    draft's); the first one refused is replaced by a draw from max(0, p_i - q_i),
    renormalised; when all stay, a draw from p_k. The emitted tokens then follow p
    exactly, whatever q is."""
    k = drafts.shape[0]
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [k + 1]
    greedy = (jnp.sum(jnp.cumprod(drafts == best[:k])), best)
    branches = branches_of(sampling) if branches is None else branches

    def sampled():
        p = jax.nn.softmax(filter_logits(logits, sampling, branches), axis=-1)  # [k + 1, V]
        q = draft_probs  # [k, V]
        u_key, r_key = jax.random.split(rng)
        rows = jnp.arange(k)
        stays = jax.random.uniform(u_key, (k,)) * q[rows, drafts] < p[rows, drafts]
        a = jnp.sum(jnp.cumprod(stays))
        residual = jnp.concatenate([jnp.maximum(p[:k] - q, 0.0), p[k:]])[a]  # [V]
        residual = jnp.where(residual.sum() > 0, residual, p[a])  # (p == q: never refused)
        new = jax.random.categorical(r_key, jnp.log(residual)).astype(jnp.int32)
        return a, jnp.where(jnp.arange(k + 1) < a, jnp.append(drafts, 0), new)

    drawn = jax.lax.cond(branches.draws, sampled, lambda: greedy)
    is_greedy = jnp.asarray(sampling.temperature) == 0
    return tuple(jnp.where(is_greedy, g, d) for g, d in zip(greedy, drawn))
