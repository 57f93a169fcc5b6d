"""Speculative decoding: a cheap draft proposes k tokens, the model scores all of them in
one cached forward of k + 1 positions, and keeps the longest prefix its own rule agrees
with plus one token of its own (jaxformer.sampling.accept_drafts): greedy output is the
model's greedy output token for token, sampled output follows its distribution exactly.

Drafts: a smaller jaxformer model with the same vocabulary and its own KV cache, or
"prompt_lookup": the k tokens that followed the latest earlier occurrence of the
context's last n-gram (no second model; strong on repetitive text such as code).

Each row decodes alone (vmapped over the batch) in caches whose slot is the position, so
a row takes back its refused tokens by emptying their slots (kv_cache.rolled_back), and
rows accept different numbers of tokens per round. Rounds run in a lax.while_loop until
every row has its tokens or its EOS: a fixed-length scan would run the worst case, one
token per round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.cached_forward import Generated, decode_jit, looped, prefill
from jaxformer.kv_cache import rolled_back
from jaxformer.sampling import accept_drafts, sample_logits

LOOKUP_NGRAM = 3  # prompt lookup matches the last 3 tokens, else 2, else 1


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


def _draft_model_proposer(draft, sample, k):
    """propose(dparams, dcache, prev, cur, pos, rng) -> (drafts [k], draft logits [k, V],
    dcache) from a draft model whose cache holds positions < pos - 1: it reads the last two
    tokens (re-writing prev at pos - 1 is harmless: slot = position), then k - 1 more."""
    def propose(dparams, dcache, prev, cur, pos, rng):
        keys = jax.random.split(rng, k)
        logits, dcache = draft.apply({"params": dparams}, jnp.stack([prev, cur])[None],
                                     (pos - 1 + jnp.arange(2))[None], cache=dcache)
        first = logits[0, -1]
        tok = sample(keys[0], first)

        def step(carry, key):
            dcache, tok, p = carry
            logits, dcache = draft.apply({"params": dparams}, tok[None, None], p[None, None],
                                         cache=dcache)
            nxt = sample(key, logits[0, 0])
            return (dcache, nxt, p + 1), (nxt, logits[0, 0])

        (dcache, _, _), (toks, qs) = jax.lax.scan(step, (dcache, tok, pos + 1), keys[1:])
        return (jnp.concatenate([tok[None], toks]), jnp.concatenate([first[None], qs]),
                dcache)
    return propose


def _emitted(s, toks, a, max_new, eos_id):
    """The round's tokens [k + 1] that count: the a kept drafts and the model's own, cut
    after an EOS and at max_new tokens in all; (how many, whether the row is done)."""
    m, eos = a + 1, False
    if eos_id is not None:
        hit = (toks == eos_id) & (jnp.arange(toks.shape[0]) < m)
        m, eos = jnp.where(hit.any(), jnp.argmax(hit) + 1, m), hit.any()
    m = jnp.minimum(m, max_new - s["n"])  # (an EOS cut off here: done by length anyway)
    return m, eos | (s["n"] + m >= max_new)


def _first_state(model, params, draft, dparams, prompt, length, rng, sample, settings):
    """A row's decoding state after its prefill (prompt [W], length []): the caches rolled
    back to hold the prompt (the draft's all but its last token), the first token drawn
    from the model."""
    max_new, k, eos_id, cache_dtype, windowed = settings
    w = prompt.shape[0]
    max_len = w + max_new + k
    args = (prompt[None], length[None], max_len, cache_dtype)
    last, cache = prefill(model, params, *args, windowed[0], k)
    rng, key = jax.random.split(rng)
    first = sample(key, last[0])
    s = dict(cache=rolled_back(cache, length), n=jnp.int32(1), cur=first,
             prev=prompt[length - 1], rng=rng,
             context=jnp.zeros(max_len + 1, jnp.int32).at[:w].set(prompt).at[length].set(first),
             out=jnp.zeros(max_new + k + 1, jnp.int32).at[0].set(first),
             logp=jnp.zeros(max_new + k + 1).at[0].set(jax.nn.log_softmax(last[0])[first]),
             done=jnp.asarray(max_new == 1) | (eos_id is not None and first == eos_id),
             drafted=jnp.int32(0), accepted=jnp.int32(0))
    if draft is not None:
        s["dcache"] = rolled_back(prefill(draft, dparams, *args, windowed[1], k)[1], length - 1)
    return s


@functools.lru_cache(maxsize=32)
def speculative_fn(cfg, draft_cfg, k: int, max_new, temperature, top_k, top_p, eos_id, pad_id,
                   cache_dtype, windowed):
    """jit(run(params, draft_params, prompts, lengths, rng) -> Generated); draft_cfg None:
    prompt lookup. windowed: (the model's, the draft's) generate's windowed_cache."""
    model, unstack = looped(cfg)
    draft, draft_unstack = looped(draft_cfg) if draft_cfg else (None, None)
    sample_args = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    sample = functools.partial(sample_logits, **sample_args)
    propose = None if draft is None else _draft_model_proposer(draft, sample, k)

    def row(params, dparams, prompt, length, rng):  # one row: prompt [W], length []
        s = _first_state(model, params, draft, dparams, prompt, length, rng, sample,
                         (max_new, k, eos_id, cache_dtype, windowed))

        def one_round(s):
            rng, kd, ka = jax.random.split(s["rng"], 3)
            pos = length + s["n"] - 1  # the position of cur, the last token emitted
            s = dict(s, rng=rng)
            if propose:
                drafts, qs, s["dcache"] = propose(dparams, s["dcache"], s["prev"], s["cur"],
                                                  pos, kd)
            else:
                drafts, qs = lookup_drafts(s["context"], pos + 1, k), None
            seq = jnp.concatenate([s["cur"][None], drafts])  # [k + 1]
            logits, cache = model.apply({"params": params}, seq[None],
                                        (pos + jnp.arange(k + 1))[None], cache=s["cache"])
            a, toks = accept_drafts(ka, logits[0], drafts, qs, **sample_args)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits[0]), toks[:, None], 1)[:, 0]
            m, done = _emitted(s, toks, a, max_new, eos_id)
            upd = jax.lax.dynamic_update_slice
            s.update(out=upd(s["out"], toks, (s["n"],)), logp=upd(s["logp"], logp, (s["n"],)),
                     context=upd(s["context"], toks, (pos + 1,)), n=s["n"] + m, done=done,
                     cache=rolled_back(cache, pos + a + 1), cur=toks[a], prev=seq[a],
                     drafted=s["drafted"] + k, accepted=s["accepted"] + a)
            if propose:
                s["dcache"] = rolled_back(s["dcache"], pos + a)
            return s

        s = jax.lax.while_loop(lambda s: ~s["done"], one_round, s)
        kept = jnp.arange(max_new) < s["n"]
        return Generated(jnp.where(kept, s["out"][:max_new], pad_id),
                         jnp.where(kept, s["logp"][:max_new], 0.0), s["n"],
                         s["drafted"], s["accepted"])

    def run(params, dparams, prompts, lengths, rng):
        params = unstack(params)
        dparams = None if draft is None else draft_unstack(dparams)
        keys = jax.random.split(rng, prompts.shape[0])
        if prompts.shape[0] == 1:  # one row: no vmap, so the cache writes stay in place
            return jax.tree.map(lambda x: x[None], row(params, dparams, prompts[0],
                                                       lengths[0], keys[0]))
        return jax.vmap(row, (None, None, 0, 0, 0))(params, dparams, prompts, lengths, keys)

    return decode_jit(run)
