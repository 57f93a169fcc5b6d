"""The engine's one compiled program: a forward of R rows (each a slot's next chunk of
tokens: a prompt's chunk, or one token of a decode step) over the paged KV cache
(jaxformer.attention.paged_cache: init_pages, paged_cache), then a token sampled per row from
the logits of its last real token, each row with its own settings and random key.

One program per (rows, chunk width, page-table width): the engine runs a few shapes of
rows (powers of two for a decode step, a few for prompt chunks) and page-table widths in
powers of two, so a program attends over at most twice the pages its longest row holds.
The LM head runs at each row's last real token alone ([R, V] logits, not [R, T, V]).
A decode step of a model whose attention layers read (row, page) pairs (decodes_by_pairs)
reads each row's own pages alone (paged_cache.pair_attention): one program per (rows,
pairs), pairs in steps of at most a third (shapes.pair_count), the page table then only
where the new tokens are written.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxformer.attention import paged_cache
from jaxformer.attention.kv_cache import recurrent_mixer
from jaxformer.core.hooks import refuse_pattern_hooks, session
from jaxformer.core.logprobs import target_logprobs
from jaxformer.core.sharding import traced_under
from jaxformer.decode.cached_forward import CPU_DECODE_OPTIONS
from jaxformer.decode.sampling import Sampling, branches_of, sample_and_filter
from jaxformer.model.inspect import run_with_hooks
from jaxformer.model.transformer import Transformer
from jaxformer.positions.schemes import POSITION_SCHEMES


def row_keys(seeds, index):
    """Each row's key for its token number `index` [R] of the stream of its seed [R, 2]
    (the seed's low and high 32 bits): the same key whatever rows run beside it."""
    def one(seed, i):
        key = jax.random.fold_in(jax.random.PRNGKey(seed[0]), seed[1])
        return jax.random.fold_in(key, i)
    return jax.vmap(one)(seeds, index)


def sampled_rows(logits, sampling: Sampling, seeds, index, bans, top: int):
    """A token per row of logits [R, V] (float32): the banned ones (bans [R, V]) never
    drawn, each row drawn with its own settings and key (row_keys); its log-prob under the
    model's own distribution (the log-softmax of the logits: generate's contract), and the
    `top` likeliest tokens' ids and log-probs [R, top]."""
    allowed = jnp.where(bans, -jnp.inf, logits)
    branches = branches_of(sampling)  # the batch's: each row's cond would run both sides

    def one(key, z, s):
        return sample_and_filter(key, z, s, branches)[0]

    tokens = jax.vmap(one)(row_keys(seeds, index), allowed, sampling)
    logp = target_logprobs(logits, tokens)
    top_logp, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top)
    return tokens, logp, top_ids.astype(jnp.int32), top_logp


def decodes_by_pairs(cfg) -> bool:
    """Whether the model's attention layers read a paged decode step's (row, page) pairs:
    not MLA's latent attention (its pages read through the tables) nor a scheme that
    computes its own logits over a row's keys in order (CoPE)."""
    return not cfg.mla.on and POSITION_SCHEMES[cfg.position].logits is None


def window_of(cfg) -> int | None:
    """How far back a model's keys are read when every attention layer has a sliding
    window: the largest (a query at q reads keys after q - window); None when a layer reads
    the whole sequence, or the position scheme counts keys in order (CoPE)."""
    if POSITION_SCHEMES[cfg.position].logits is not None:
        return None
    windows = [cfg.kinds[kind].window for i, kind in enumerate(cfg.layer_kind_ids)
               if not recurrent_mixer(cfg, i)]
    return None if not windows or None in windows else max(windows)


def checked_hooks(model, params, hooks: dict) -> None:
    """Refuses, in one line, hooks a step cannot apply: on attention patterns (its cached
    path computes none), or on a name that is no hook point of the model (traced once,
    abstractly: nothing runs)."""
    refuse_pattern_hooks(hooks, "the engine")
    jax.eval_shape(lambda p: run_with_hooks(model, p, jnp.zeros((1, 1), jnp.int32),
                                            hooks=hooks), params)


def paged_forward(model, params, pool, tokens, starts, counts, table, rows, pairs=None):
    """The logits [R, V] of each row's last real token and the pool after tokens [R, T]
    (counts [R] real ones each, at positions starts + 0, 1, ...) went through the model
    over the paged cache; rows [R]: each row's slot (its recurrent state; a padding row's
    an id >= slots); pairs: a decode step's (row, page) pairs (paged_cache), or None."""
    t = tokens.shape[1]
    cache = paged_cache.paged_cache(pool, table, starts, counts, rows, pairs)
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)  # [R, T]
    segments = (jnp.arange(t) < counts[:, None]).astype(jnp.int32)  # 0: padding
    logits, cache = model.apply({"params": params}, tokens, positions, segments, cache=cache,
                                last=jnp.maximum(counts - 1, 0))  # the head at one token
    return logits[:, 0].astype(jnp.float32), paged_cache.paged_pool(pool, cache, rows)  # [R, V]


def step_program(cfg, top: int, mesh=None, rules=None, hooks=None):
    """The jitted step(params, pool, tokens, starts, counts, table, rows, sampling, seeds,
    index, bans, pairs=None) -> (pool, (tokens, logprobs, top ids, top log-probs)) of the
    model of cfg (a decoding config: cached_forward.decoding_config), the pool donated
    (updated in place), compiled as the decoders are (CPU_DECODE_OPTIONS on CPU); traced
    inside the sharding context of `mesh` and `rules` when given, and with `hooks` ({name:
    fn}, as generate takes them: to each chunk's and each new token's values) applied."""
    return _step_program(cfg, top, mesh, rules, tuple(sorted((hooks or {}).items())))


@functools.lru_cache(maxsize=16)
def _step_program(cfg, top: int, mesh, rules, hooks: tuple):
    model = Transformer(cfg)

    def step(params, pool, tokens, starts, counts, table, rows, sampling, seeds, index, bans,
             pairs=None):
        with session(dict(hooks), lambda _: False) if hooks else contextlib.nullcontext():
            last, pool = paged_forward(model, params, pool, tokens, starts, counts, table,
                                       rows, pairs)
        return pool, sampled_rows(last, sampling, seeds, index, bans, top)

    options = CPU_DECODE_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(traced_under(mesh, rules, step), donate_argnums=(1,),
                   compiler_options=options)
