"""Speculative decoding: a cheap draft proposes k tokens, the model scores all of them in
one cached forward of k + 1 positions, and keeps the longest prefix its own rule agrees
with plus one token of its own (jaxformer.decode.sampling.accept_drafts): greedy output is the
model's greedy output token for token, sampled output follows its distribution exactly.

Drafts come from a proposer (PROPOSERS): a smaller jaxformer model with the same
vocabulary and its own KV cache, prompt lookup: the k tokens that followed the latest
earlier occurrence of the context's last n-gram (no second model; strong on repetitive
text such as code), or mtp: the model's own multi-token prediction modules
(model.mtp_depth, jaxformer.model.mtp) reading its last hidden states (mtp_proposer).

Each row decodes alone (vmapped over the batch) in caches whose slot is the position, so
a row takes back its refused tokens by emptying their slots (kv_cache.rolled_back), and
rows accept different numbers of tokens per round. Rounds run in a lax.while_loop until
every row has its tokens or its EOS: a fixed-length scan would run the worst case, one
token per round. A model (or draft) with recurrent layers is refused (check_rolls_back):
their state has read the refused drafts, and has no slots to empty.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.attention.kv_cache import init_cache, rolled_back
from jaxformer.core.logprobs import target_logprobs
from jaxformer.decode.cached_forward import Generated, decode_jit, looped, prefill
from jaxformer.decode.sampling import (Branches, Sampling, accept_drafts, branches_of,
                                       sample_and_filter, sample_logits)
from jaxformer.model.mixers import MIXERS
from jaxformer.model.mtp import init_module_cache
from jaxformer.model.transformer import Transformer

LOOKUP_NGRAM = 3  # prompt lookup matches the last 3 tokens, else 2, else 1


class RowState(NamedTuple):
    """One row's decoding state between rounds (the while_loop's carry)."""
    cache: dict           # the model's KV cache (slot = position), up to before `cur`
    draft_state: Any      # the proposer's: a draft model's KV cache; () for prompt lookup
    context: jax.Array    # int32 [max_len + 1]: the prompt, then the tokens emitted
    out: jax.Array        # int32 [max_new + k + 1]: the tokens emitted
    logp: jax.Array       # float32 [max_new + k + 1]: their log-probs under the model
    n: jax.Array          # int32 []: how many tokens are emitted
    cur: jax.Array        # int32 []: the last of them, not yet in the model's cache
    prev: jax.Array       # int32 []: the token before it
    done: jax.Array       # bool []: the row has its tokens or its EOS
    drafted: jax.Array    # int32 []: tokens proposed
    accepted: jax.Array   # int32 []: of those, the ones the model kept
    rng: jax.Array
    hidden: Any = ()      # float [max_len + 1, D]: the model's last hidden state at each
    #                       position (before the final norm), for a proposer that reads it


class Proposer(NamedTuple):
    """How a row's k drafts are made, each round.
    start(dparams, prompt [W], length [], max_len, cache_dtype, windowed, hidden) -> its
    state; propose(dparams, state, row: RowState, pos, rng, sampling, branches) -> (drafts
    int32 [k], draft_probs [k, V]: the distribution each was drawn from, state); pos: cur's
    position; sampling: the row's; branches: the batch's (jaxformer.decode.sampling.Branches).
    target: it drafts with the model's own params (dparams) and reads its hidden states
    (hidden: the prompt's [W, D] at start, row.hidden after); else hidden is None."""
    start: Callable
    propose: Callable
    target: bool = False


def lookup_drafts(context, end, k: int, ngram: int = LOOKUP_NGRAM):
    """The k tokens after the latest earlier occurrence of the last n tokens of
    context[:end] (context int32 [C]), for the longest n <= ngram that occurs; the last
    token repeated when none does. An occurrence p tokens back predicts a text that
    repeats with period p, so the proposal goes on past `end` by repeating its last p
    tokens (a run of spaces, a repeated line being written)."""
    c = context.shape[0]
    j = jnp.arange(c)  # the last token of a candidate occurrence
    run = jnp.ones(c, bool)
    length = jnp.zeros(c, jnp.int32)
    for i in range(ngram):  # length: how many of the last tokens match, ending at j
        tail = end - 1 - i
        run = run & (j >= i) & (tail >= 0) & (context[jnp.maximum(j - i, 0)] ==
                                              context[jnp.maximum(tail, 0)])
        length = length + run
    length = jnp.where(j <= end - 2, length, 0)  # strictly earlier than the last token
    best = jnp.argmax(length * c + j)  # the longest match, then the latest
    period = jnp.maximum(end - 1 - best, 1)
    follow = context[best + 1 + jnp.arange(k) % period]
    return jnp.where(length[best] > 0, follow, context[end - 1])


def prompt_lookup_proposer(draft, k: int, vocab: int) -> Proposer:
    """lookup_drafts from the row's context; no state (draft: None)."""
    def propose(dparams, state, row, pos, rng, sampling, branches):
        drafts = lookup_drafts(row.context, pos + 1, k)
        return drafts, jax.nn.one_hot(drafts, vocab), state
    return Proposer(lambda *_: (), propose)


def mtp_proposer(model, k: int, vocab: int) -> Proposer:
    """Drafts from the model's MTP modules (model.mtp_depth = D): draft m (the token at
    cur's position + m) is module m's prediction at the position before cur, from h^{m-1}
    there (h^0: the model's own hidden state) and the embedding of the token m - 1 after
    it (cur, then the drafts). Past D the last module is chained (draft m > D runs module
    D on draft m - 1's hidden state). Each draft keeps its module's KV cache (slot =
    position): each round it is rolled back and rewritten over the window of k + 1
    positions that ends before cur, which holds every element whose token or hidden state
    the last round drafted; what lies after cur is taken back."""
    cfg = model.cfg
    depths = [min(m, cfg.mtp_depth) for m in range(1, k + 1)]

    def start(params, prompt, length, max_len, cache_dtype, windowed, hidden):
        w, keep = prompt.shape[0], jnp.maximum(length - 1 - k, 0)
        tokens = jnp.concatenate([prompt, jnp.zeros(k, prompt.dtype)])
        real = (jnp.arange(w) < length).astype(jnp.int32)[None]
        h, caches = hidden[None], []
        for m, depth in enumerate(depths, 1):  # each module over the prompt, chained
            cache = init_module_cache(cfg, 1, max_len, cache_dtype)
            _, h, cache = model.apply({"params": params}, tokens[None, m:m + w],
                                      jnp.arange(w)[None], real, cache=cache, depth=depth,
                                      previous=h)
            caches.append(rolled_back(cache, keep))  # the elements whose tokens it read
        return tuple(caches)

    def propose(params, caches, row, pos, rng, sampling, branches):
        s = jnp.maximum(pos - 1 - k, 0)  # the window: positions s .. s + k, pos - 1 among them
        idx = (s + jnp.arange(k + 1))[None]
        spec = jnp.concatenate([row.context, jnp.zeros(k + 1, jnp.int32)])  # + the drafts
        h = jax.lax.dynamic_slice_in_dim(row.hidden, s, k + 1)[None]  # [1, k + 1, D]
        drafts, probs, out = [], [], []
        for m, (depth, key) in enumerate(zip(depths, jax.random.split(rng, k)), 1):
            toks = jax.lax.dynamic_slice_in_dim(spec, s + m, k + 1)[None]  # t_{j+m}
            logits, h, cache = model.apply({"params": params}, toks, idx, cache=rolled_back(
                caches[m - 1], s), depth=depth, previous=h)
            tok, z = sample_and_filter(key, logits[0, pos - 1 - s], sampling, branches)
            spec = spec.at[pos + m].set(tok)
            drafts.append(tok)
            probs.append(jax.nn.softmax(z))
            out.append(rolled_back(cache, pos))  # past cur: drafts' elements, taken back
        return jnp.stack(drafts), jnp.stack(probs), tuple(out)
    return Proposer(start, propose, target=True)


def draft_model_proposer(draft, k: int, vocab: int) -> Proposer:
    """k tokens drawn from `draft` (a looped Transformer) with the row's sampling, in a KV
    cache of its own. At a round's start its cache is rolled back to the positions before
    prev's (pos - 1): it reads prev and cur (re-writing prev is harmless: slot =
    position), then k - 1 more."""
    def start(dparams, prompt, length, max_len, cache_dtype, windowed, hidden=None):
        return prefill(draft, dparams, prompt[None], length[None], max_len, cache_dtype,
                       windowed, k)[1]

    def propose(dparams, dcache, row, pos, rng, sampling, branches):
        apply = functools.partial(draft.apply, {"params": dparams})
        sample = functools.partial(sample_and_filter, sampling=sampling, branches=branches)
        keys = jax.random.split(rng, k)
        logits, dcache = apply(jnp.stack([row.prev, row.cur])[None],
                               (pos - 1 + jnp.arange(2))[None], cache=rolled_back(dcache, pos - 1))
        tok, first = sample(keys[0], logits[0, -1])

        def step(carry, key):
            dcache, tok, p = carry
            logits, dcache = apply(tok[None, None], p[None, None], cache=dcache)
            nxt, z = sample(key, logits[0, 0])
            return (dcache, nxt, p + 1), (nxt, z)

        (dcache, _, _), (toks, zs) = jax.lax.scan(step, (dcache, tok, pos + 1), keys[1:])
        probs = jax.nn.softmax(jnp.concatenate([first[None], zs]), axis=-1)  # [k, V]
        return jnp.concatenate([tok[None], toks]), probs, dcache
    return Proposer(start, propose)


DRAFT_MODEL = "draft_model"  # the proposer of generate's draft=(model, params)
# the proposers, by name: generate's draft names one of the others
PROPOSERS = {DRAFT_MODEL: draft_model_proposer, "prompt_lookup": prompt_lookup_proposer,
             "mtp": mtp_proposer}
# what a proposer drafting with the model itself needs of it: (whether cfg has it, the line
# refusing it otherwise, its draft_len by default)
NEEDS = {mtp_proposer: (lambda cfg: cfg.mtp_depth > 0,
                        "draft=mtp drafts with the model's multi-token prediction modules, "
                        "and this model has none (model.mtp_depth=0)",
                        lambda cfg: cfg.mtp_depth)}


def default_draft_len(cfg, draft) -> int:
    """A proposer's drafts per round when none is asked for: 4, or its NEEDS entry's."""
    need = NEEDS.get(PROPOSERS.get(draft)) if isinstance(draft, str) else None
    return 4 if need is None or not need[0](cfg) else need[2](cfg)


def checked_draft(cfg, draft, k: int):
    """generate's `draft` as (proposer name, the draft model's config or None, its params);
    errors name the fix."""
    if k < 1:
        raise ValueError(f"draft_len must be >= 1, got {k}")
    check_rolls_back(cfg, "the model")
    names = [n for n in PROPOSERS if n != DRAFT_MODEL]
    if isinstance(draft, str) and draft in names:
        has, refusal, _ = NEEDS.get(PROPOSERS[draft], (lambda cfg: True, "", None))
        if not has(cfg):
            raise ValueError(refusal)
        return draft, None, None
    if not (isinstance(draft, tuple) and len(draft) == 2 and isinstance(draft[0], Transformer)):
        raise ValueError(f"draft must be a (jaxformer Transformer, params) pair or one of "
                         f"{names}, got {draft!r:.80}")
    dcfg = draft[0].cfg
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"the draft model's vocab_size {dcfg.vocab_size} differs from the "
                         f"model's {cfg.vocab_size}; a draft must share the tokenizer")
    if dcfg.max_seq_len < cfg.max_seq_len:
        raise ValueError(f"the draft model's max_seq_len {dcfg.max_seq_len} is below the "
                         f"model's {cfg.max_seq_len}; it reads the same positions")
    check_rolls_back(dcfg, "the draft model")
    return DRAFT_MODEL, dcfg, draft[1]


def check_rolls_back(cfg, whose: str) -> None:
    """Refuses, in one line, a model whose cache cannot be rolled back: each round takes
    back the refused drafts by emptying their slots (kv_cache.rolled_back), and a recurrent
    layer's state holds every token it has read, with no slot to empty."""
    recurrent = sorted({m for m in cfg.layer_mixers + cfg.layer_parallels
                        if m and MIXERS[m].recurrent})
    if recurrent:
        raise ValueError(f"speculative decoding cannot take back drafts that {whose}'s "
                         f"recurrent layers ({', '.join(recurrent)}) have read into their "
                         "state; pass draft=None")


def _emitted(row: RowState, toks, a, max_new, eos_id):
    """The round's tokens [k + 1] that count: the a kept drafts and the model's own, cut
    after an EOS and at max_new tokens in all; (how many, whether the row is done)."""
    m, eos = a + 1, False
    if eos_id is not None:
        hit = (toks == eos_id) & (jnp.arange(toks.shape[0]) < m)
        m, eos = jnp.where(hit.any(), jnp.argmax(hit) + 1, m), hit.any()
    m = jnp.minimum(m, max_new - row.n)  # (an EOS cut off here: done by length anyway)
    return m, eos | (row.n + m >= max_new)


def _first_row(model, params, proposer, dparams, prompt, length, rng, sampling: Sampling,
               branches: Branches, settings):
    """A row's state after its prefill (prompt [W], length []): the model's cache rolled
    back to hold the prompt, the proposer started, the first token drawn from the model."""
    max_new, k, eos_id, cache_dtype, windowed = settings
    w = prompt.shape[0]
    max_len = w + max_new + k
    last, cache, hidden = prefill_hidden(model, params, prompt, length, max_len, cache_dtype,
                                         windowed[0], k, proposer.target)
    rng, key = jax.random.split(rng)
    first = sample_logits(key, last, sampling, branches)
    return RowState(
        cache=rolled_back(cache, length),
        draft_state=proposer.start(dparams, prompt, length, max_len, cache_dtype, windowed[1],
                                   hidden),
        context=jnp.zeros(max_len + 1, jnp.int32).at[:w].set(prompt).at[length].set(first),
        out=jnp.zeros(max_new + k + 1, jnp.int32).at[0].set(first),
        logp=jnp.zeros(max_new + k + 1).at[0].set(target_logprobs(last, first)),
        n=jnp.int32(1), cur=first, prev=prompt[length - 1],
        done=jnp.asarray(max_new == 1) | (eos_id is not None and first == eos_id),
        drafted=jnp.int32(0), accepted=jnp.int32(0), rng=rng,
        hidden=() if hidden is None else jnp.zeros((max_len + 1, hidden.shape[-1]),
                                                   hidden.dtype).at[:w].set(hidden))


def prefill_hidden(model, params, prompt, length, max_len, cache_dtype, windowed, k,
                   hidden: bool):
    """One row's prefill (cached_forward.prefill): (the last real token's logits [V], the
    cache, with `hidden` the prompt's last hidden states [W, D], else None)."""
    if not hidden:
        last, cache = prefill(model, params, prompt[None], length[None], max_len, cache_dtype,
                              windowed, k)
        return last[0], cache, None
    w = prompt.shape[0]
    cache = init_cache(model.cfg, 1, max_len, cache_dtype, windowed=windowed, spare=k)
    real = (jnp.arange(w) < length).astype(jnp.int32)[None]
    logits, h, cache = model.apply({"params": params}, prompt[None], jnp.arange(w)[None], real,
                                   cache=cache, hidden=True)
    return logits[0, length - 1], cache, h[0]


@functools.lru_cache(maxsize=32)
def speculative_fn(cfg, proposer: str, draft_cfg, k: int, max_new, eos_id, pad_id,
                   cache_dtype, windowed):
    """jit(run(params, draft_params, prompts, lengths, rng, sampling) -> Generated);
    proposer: a PROPOSERS name (draft_cfg: the draft model's, or None); windowed: (the
    model's, the draft's) generate's windowed_cache; sampling: per row ([batch] fields),
    read by the rows' conds as the whole batch's Branches."""
    model, unstack = looped(cfg)
    draft, draft_unstack = looped(draft_cfg) if draft_cfg else (None, lambda p: p)
    drafting = PROPOSERS[proposer](draft or model, k, cfg.vocab_size)

    def row(params, dparams, prompt, length, rng, sampling: Sampling, branches: Branches):
        def one_round(r: RowState) -> RowState:
            rng, kd, ka = jax.random.split(r.rng, 3)
            pos = length + r.n - 1  # the position of cur, the last token emitted
            drafts, q, draft_state = drafting.propose(dparams, r.draft_state, r, pos, kd,
                                                      sampling, branches)
            seq = jnp.concatenate([r.cur[None], drafts])  # [k + 1]
            out = model.apply({"params": params}, seq[None], (pos + jnp.arange(k + 1))[None],
                              cache=r.cache, hidden=drafting.target)
            logits, cache, hidden = (out[0], out[-1], out[1] if drafting.target else None)
            a, toks = accept_drafts(ka, logits[0], drafts, q, sampling, branches)
            logp = target_logprobs(logits[0], toks)  # [k + 1]
            m, done = _emitted(r, toks, a, max_new, eos_id)
            upd = jax.lax.dynamic_update_slice
            return r._replace(
                cache=rolled_back(cache, pos + a + 1), draft_state=draft_state,
                context=upd(r.context, toks, (pos + 1,)), out=upd(r.out, toks, (r.n,)),
                logp=upd(r.logp, logp, (r.n,)), n=r.n + m, cur=toks[a], prev=seq[a],
                done=done, drafted=r.drafted + k, accepted=r.accepted + a, rng=rng,
                hidden=r.hidden if hidden is None else upd(r.hidden, hidden[0], (pos, 0)))

        r = _first_row(model, params, drafting, dparams, prompt, length, rng, sampling,
                       branches, (max_new, k, eos_id, cache_dtype, windowed))
        r = jax.lax.while_loop(lambda r: ~r.done, one_round, r)
        kept = jnp.arange(max_new) < r.n
        return Generated(jnp.where(kept, r.out[:max_new], pad_id),
                         jnp.where(kept, r.logp[:max_new], 0.0), r.n, r.drafted, r.accepted)

    def run(params, dparams, prompts, lengths, rng, sampling):
        params = unstack(params)
        dparams = params if drafting.target else draft_unstack(dparams)
        keys = jax.random.split(rng, prompts.shape[0])
        branches = branches_of(sampling)  # the batch's, outside the vmap: conds stay conds
        if prompts.shape[0] == 1:  # one row: no vmap, so the cache writes stay in place
            first = lambda x: x[0]  # noqa: E731
            return jax.tree.map(lambda x: x[None], row(
                params, dparams, prompts[0], lengths[0], keys[0], jax.tree.map(first, sampling),
                branches))
        return jax.vmap(row, (None, None, 0, 0, 0, 0, None))(params, dparams, prompts, lengths,
                                                             keys, sampling, branches)

    return decode_jit(run)
