"""The paged KV cache: the keys and values of every sequence in one pool of fixed-size pages.

A paged cache (init_pages; jaxformer.serve runs it) holds each attention layer's keys
and values in a pool of fixed-size pages, ``k`` [pages, rows per batch row, page_size, H]
(MLA: the rotated key and the latent, as cache_widths says), shared by every sequence; a
sequence owns a page table, the pages of its tokens in order, so that its token at logical
index j (position j) sits in page table[j // page_size] at offset j % page_size. A
recurrent layer's entries keep one row per sequence slot [slots, ...]. For one forward,
paged_cache hands each attention layer the pool and the forward's rows' ``page_table``
[R, M], ``starts`` [R] (tokens already held: where the new ones go) and ``counts`` [R]
(the real new tokens; the rest of a row is padding, never written); the layer writes its
new keys (write_pages) and attends over its rows' pages laid out in logical order
(page_view), the slots past a row's tokens masked as EMPTY_SLOT. A sliding window is a
mask there, not a ring. paged_pool takes the pool back out of the forward's cache.
The layout's key positions are jaxformer.attention.kv_cache's (paged_positions, read by
key_positions for any cache). The pages hold keys and values in a cache format
(jaxformer.attention.cache_formats: a float dtype, or int8 with a float32 scale per token
and head, each entry then a Quantised pair of pools); a read gathers the pages in that
format and dequantises what it gathered.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.attention.cache_formats import cache_format, encoded
from jaxformer.attention.kv_cache import (
    PAIR_ENTRIES,
    ROW_ENTRIES,
    cache_widths,
    check_generates,
    recurrent_mixer,
)
from jaxformer.core.reference import group_sinks, scale_and_mask


def init_pages(cfg, pages: int, page_size: int, slots: int, dtype=None):
    """An empty paged cache: each attention layer's ``k``, ``v`` [pages, rows per batch
    row, page_size, width] (cache_widths: a page holds each head's slots together, so that
    page_view reads a row's heads in one gather) in the format `dtype` (cache_formats; the
    model's dtype by default; int8: Quantised, with scales [pages, rows, page_size, 1]),
    each recurrent layer's entries [slots, ...] (zeros); unscanned layers (``block_i``)."""
    check_generates(cfg)
    if cfg.scan_layers:
        raise ValueError("a paged KV cache needs unscanned layers; use scan_layers=false "
                         "(jaxformer.decode.cached_forward.decoding_config)")
    fmt = cache_format(dtype or cfg.dtype)
    state_dtype = fmt.state_dtype(cfg.dtype)
    per_row, k_width, v_width = cache_widths(cfg)
    layers = {}
    for i in range(cfg.n_layers):
        own = {n: jnp.zeros((slots, *shape), d or state_dtype)
               for n, (shape, d) in (cfg.recurrent_cache(i) or {}).items()}
        keys = {} if recurrent_mixer(cfg, i) else {
            "k": fmt.empty((pages, per_row, page_size, k_width)),
            "v": fmt.empty((pages, per_row, page_size, v_width))}
        layers[f"block_{i}"] = {**keys, **own}
    return {"layers": layers}


def paged_cache(pool, table, starts, counts, rows, pairs=None):
    """The cache one forward over R rows reads: the pool's pages with the rows' page
    tables table [R, M] (an entry past a row's pages: any id >= pages), starts and counts
    [R]; each recurrent entry the rows' slots `rows` [R] (zeros where a row starts at 0: a
    new sequence; a row id >= slots: none, zeros). pairs: (pair_row, pair_page,
    pair_index) [P] for a decode step read by pairs (pair_attention), else None."""
    by_pair = {} if pairs is None else dict(zip(PAIR_ENTRIES, pairs))
    def layer(entries):
        out = {}
        for name, x in entries.items():
            if name in ROW_ENTRIES:  # [slots, ...] -> the rows' [R, ...]
                got = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
                fresh = (starts == 0).reshape(-1, *(1,) * (x.ndim - 1))
                out[name] = jnp.where(fresh, jnp.zeros_like(got), got)
            else:
                out[name] = x
        if "k" in entries:
            out.update(page_table=table, starts=starts, counts=counts, **by_pair)
        return out

    return {"layers": {n: layer(x) for n, x in pool["layers"].items()},
            "page_table": table, "starts": starts, "counts": counts,
            "index": jnp.zeros([], jnp.int32), **by_pair}


def paged_pool(pool, cache, rows):
    """The pool after a forward over paged_cache(pool, ..., rows): its pages as the layers
    wrote them, each recurrent entry's rows written back to their slots (a row id >= slots,
    a padding row's: dropped)."""
    def layer(old, new):
        return {name: x.at[rows].set(new[name].astype(x.dtype), mode="drop")
                if name in ROW_ENTRIES else new[name] for name, x in old.items()}

    return {"layers": {n: layer(x, cache["layers"][n]) for n, x in pool["layers"].items()}}


def is_paged(layer) -> bool:
    """Whether a layer's cache is a paged one's (paged_cache)."""
    return "page_table" in layer


def write_pages(layer, k, v):
    """A paged layer with k, v [R, T, K, H] written: row r's token t (t < counts[r]) at
    logical index starts[r] + t of its pages; padding and indices past its table dropped."""
    pages, _, page_size = layer["k"].shape[:3]
    t = k.shape[1]
    index = layer["starts"][:, None] + jnp.arange(t)  # [R, T]: logical
    logical = index // page_size
    m = layer["page_table"].shape[1]
    page = jnp.take_along_axis(layer["page_table"], jnp.minimum(logical, m - 1), axis=1)
    real = (jnp.arange(t) < layer["counts"][:, None]) & (logical < m)
    page = jnp.where(real, page, pages)  # page `pages`: out of range, dropped

    def put(pool, new):  # pool [P, K, ps, H] at (page, :, offset) [R, T] <- new [R, T, K, H]
        return jax.tree.map(lambda x, n: x.at[page, :, index % page_size].set(n, mode="drop"),
                            pool, encoded(pool, new))

    return dict(layer, k=put(layer["k"], k), v=put(layer["v"], v))


def taken(pages, ids):
    """The pages `ids` (any shape) of a pool [P, ...] (an array or a Quantised pair) in its
    format; an id past the pool reads its last page."""
    return jax.tree.map(lambda x: jnp.take(x, ids, axis=0, mode="clip"), pages)


def page_view(pages, table):
    """The pages of each row's table [R, M] from a pool [P, K, ps, H], in logical order, as
    a cache layer's rows [R * K, M * ps, H] in the pool's format: whole pages gathered, then
    heads moved ahead (XLA:CPU gathers a page of every head ~10x faster than a head's slice
    of each page); an id past the pool reads its last page, masked by the positions."""
    _, n_kv, ps, _ = pages.shape
    r, m = table.shape
    return jax.tree.map(lambda x: x.swapaxes(1, 2).reshape(r * n_kv, m * ps, x.shape[-1]),
                        taken(pages, table))  # from [R, M, K, ps, H]


def paged_keys(layer, k, v):
    """A paged layer's cache with k, v [R, T, K, H] written, and the keys and values its
    rows attend over [R * K, M * ps, H] (paged_positions mark which are held)."""
    layer = write_pages(layer, k, v)
    table = layer["page_table"]
    return page_view(layer["k"], table), page_view(layer["v"], table), layer


def pair_rule(rule, layer):
    """A MaskRule of the forward (its key positions already the pairs', [P, page_size]:
    kv_cache.paged_positions) with each pair's row's query positions [P, 1]."""
    return rule.replace(q_positions=jnp.take(rule.q_positions, layer["pair_row"], axis=0,
                                             mode="fill", fill_value=0))


def pair_attention(q, layer, mask, bias=None, *, softcap=None, sinks=None):
    """Attention of one new token per row q [R, 1, N, H] over the pages its row holds,
    read as the layer's (row, page) pairs: each pair's logits [P, K, G, 1, page_size]
    (scaled, soft-capped, + bias [P, N, 1, page_size], masked by mask [P, 1, 1,
    page_size]), then a softmax over each row's pairs (segment max and sums, sinks [N]
    in both as cached_attention's), the values' weighted sums summed per row -> [R, 1, N, Hv]
    in q's dtype (a row with no pair: zeros)."""
    r, _, n, h = q.shape
    rows, n_kv = layer["pair_row"], layer["k"].shape[1]
    k = taken(layer["k"], layer["pair_page"]).astype(q.dtype)  # [P, K, ps, H]
    v = taken(layer["v"], layer["pair_page"]).astype(q.dtype)
    qp = jnp.take(q.reshape(r, n_kv, n // n_kv, h), rows, axis=0, mode="clip")  # [P, K, G, H]
    logits = jnp.einsum("pkgh,pksh->pkgs", qp, k, preferred_element_type=jnp.float32)
    logits = scale_and_mask(logits[:, :, :, None], mask=mask, bias=bias,
                            scale=1.0 / math.sqrt(h), softcap=softcap)  # [P, K, G, 1, ps]
    segments = dict(segment_ids=rows, num_segments=r, indices_are_sorted=True)
    peak = jax.ops.segment_max(jnp.max(logits, axis=-1), **segments)  # [R, K, G, 1]
    sinks = group_sinks(sinks, n_kv)  # [K, G, 1, 1] or None
    if sinks is not None:
        peak = jnp.maximum(peak, sinks[..., 0])
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    e = jnp.exp(logits - jnp.take(peak, rows, axis=0, mode="clip")[..., None])
    total = jax.ops.segment_sum(jnp.sum(e, axis=-1), **segments)
    if sinks is not None:
        total = total + jnp.exp(sinks[..., 0] - peak)
    out = jax.ops.segment_sum(jnp.einsum("pkgts,pksh->pkgth", e.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32), **segments)
    out = out / jnp.where(total == 0, 1.0, total)[..., None]  # [R, K, G, 1, Hv]
    return out.transpose(0, 3, 1, 2, 4).reshape(r, 1, n, v.shape[-1]).astype(q.dtype)
