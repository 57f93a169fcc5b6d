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
key_positions for any cache). The paged layout holds floats only.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxformer.attention.kv_cache import (
    ROW_ENTRIES,
    cache_widths,
    check_generates,
    recurrent_mixer,
)


def init_pages(cfg, pages: int, page_size: int, slots: int, dtype=None):
    """An empty paged cache: each attention layer's ``k``, ``v`` [pages, rows per batch
    row, page_size, width] (cache_widths: a page holds each head's slots together, so that
    page_view reads a row's heads in one gather), each recurrent layer's entries [slots,
    ...] (zeros); unscanned layers (``block_i``)."""
    check_generates(cfg)
    if cfg.scan_layers:
        raise ValueError("a paged KV cache needs unscanned layers; use scan_layers=false "
                         "(jaxformer.decode.cached_forward.decoding_config)")
    dtype = jnp.dtype(dtype or cfg.dtype)
    per_row, k_width, v_width = cache_widths(cfg)
    layers = {}
    for i in range(cfg.n_layers):
        own = {n: jnp.zeros((slots, *shape), d or dtype)
               for n, (shape, d) in (cfg.recurrent_cache(i) or {}).items()}
        keys = {} if recurrent_mixer(cfg, i) else {
            "k": jnp.zeros((pages, per_row, page_size, k_width), dtype),
            "v": jnp.zeros((pages, per_row, page_size, v_width), dtype)}
        layers[f"block_{i}"] = {**keys, **own}
    return {"layers": layers}


def paged_cache(pool, table, starts, counts, rows):
    """The cache one forward over R rows reads: the pool's pages with the rows' page
    tables table [R, M] (an entry past a row's pages: any id >= pages), starts and counts
    [R]; each recurrent entry the rows' slots `rows` [R] (zeros where a row starts at 0: a
    new sequence; a row id >= slots: none, zeros)."""
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
            out.update(page_table=table, starts=starts, counts=counts)
        return out

    return {"layers": {n: layer(x) for n, x in pool["layers"].items()},
            "page_table": table, "starts": starts, "counts": counts,
            "index": jnp.zeros([], jnp.int32)}


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
        return pool.at[page, :, index % page_size].set(new.astype(pool.dtype), mode="drop")

    return dict(layer, k=put(layer["k"], k), v=put(layer["v"], v))


def page_view(pages, table):
    """The pages of each row's table [R, M] from a pool [P, K, ps, H], in logical order, as
    a cache layer's rows [R * K, M * ps, H]: whole pages gathered, then heads moved ahead
    (XLA:CPU gathers a page of every head ~10x faster than a head's slice of each page); an
    id past the pool reads its last page, masked by the positions."""
    _, n_kv, ps, h = pages.shape
    r, m = table.shape
    x = jnp.take(pages, table, axis=0, mode="clip")  # [R, M, K, ps, H]
    return x.swapaxes(1, 2).reshape(r * n_kv, m * ps, h)


def paged_keys(layer, k, v):
    """A paged layer's cache with k, v [R, T, K, H] written, and the keys and values its
    rows attend over [R * K, M * ps, H] (paged_positions mark which are held)."""
    layer = write_pages(layer, k, v)
    table = layer["page_table"]
    return page_view(layer["k"], table), page_view(layer["v"], table), layer
