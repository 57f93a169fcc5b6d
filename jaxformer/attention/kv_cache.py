"""The KV cache: its layout, made, written and read in this one module.

A cache is a pytree: ``layers`` laid out like the params, per layer (``block_i``) or
stacked along a leading layer axis (``blocks``, or each of cfg.layer_runs, with
scan_layers), each holding ``k`` and ``v`` [batch * n_kv_heads, max_len, head_dim] (row
b * n_kv_heads + h: batch row b's head h); ``positions`` [batch, max_len], the position
of the token in each slot (EMPTY_SLOT for none, e.g. a prompt's padding); and ``index``,
the next slot to write. Every row writes its next token into the same slot, so rows with
prompts of different lengths decode together, each at its own positions, and the cache is
updated in place.

A layer with a sliding window w shorter than the cache (a windowed cache, `windowed=True`;
unscanned layers, as generate runs them) keeps a ring of w slots instead: the token at
position p sits in slot p % w, and the layer's own ``positions`` [batch, w] say which
position each slot holds. A query at p sees positions p - w + 1 .. p, one per slot, so
nothing it can see is overwritten while the positions of a row only grow (as in decoding;
a rollback to an earlier position needs the full-length cache). Its bytes are w / max_len
of a full layer's.

An MLA layer (jaxformer.attention.mla) caches its latent as ``v`` [batch, max_len, kv_lora_rank] and
its rotated key as ``k`` [batch, max_len, qk_rope_head_dim]: one row per batch row
(cache_widths), kv_lora_rank + qk_rope_head_dim numbers per token.

A layer whose mixer is recurrent (cfg.recurrent_cache(i): gated_delta, mamba2,
short_conv) holds its own entries instead, e.g. ``state`` [batch, ...] (float32) and
``conv`` [batch, kernel - 1, channels]: a constant size whatever the length, written by the
layer itself; the slots' positions and index serve the attention layers. A layer with a
parallel mixer beside its attention (model.layer_kinds.<kind>.parallel: Falcon-H1) holds
both: its keys and values and that mixer's entries, in one dict.

A paged cache (jaxformer.attention.paged_cache) holds the attention layers' keys in a pool of
fixed-size pages; key_positions reads its rows' positions (paged_positions).

The keys and values are held in a format (jaxformer.attention.cache_formats, chosen by
init_cache's dtype): a float dtype, or int8, where each entry is a Quantised pair, int8
values [..., S, H] and float32 scales [..., S, 1] (one per row, slot: per token and K/V
head); writes quantise the new tokens alone (encoded), attention reads the entry
dequantised (``.astype``). A paged cache holds floats only.

One row axis, not [B, K, S, H]: at batch 1 XLA drops the size-1 batch axis from the
matmuls, and the reshape that then sits between the in-place cache update and the matmul
made XLA:CPU copy each layer's K four times and transpose V on every decode step
(bench/decode.py, batch 1: ~0.45 -> ~0.2 ms per token). B * K == 1 (MQA at batch 1) still
collapses, and still copies. [B, S, K, H] transposes the cache at every batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.attention.cache_formats import cache_format, encoded
from jaxformer.core.reference import group_sinks, scale_and_mask, softmax
from jaxformer.core.sharding import constrain
from jaxformer.core.validation import ConfigError

PAIR_ENTRIES = ("pair_row", "pair_page", "pair_index")  # a paged decode step read by pairs
ROW_ENTRIES = ("positions", "state", "conv")  # one per batch row: a ring's, a recurrent layer's
EMPTY_SLOT = 2**30  # the position of a cache slot holding nothing: later than any query


def layer_slots(cfg, max_len: int, windowed: bool = False, spare: int = 0) -> tuple[int, ...]:
    """Each layer's slots: max_len, or in a windowed cache its window (+ spare) where that
    is shorter (a ring)."""
    if not windowed:
        return (max_len,) * cfg.n_layers
    windows = [cfg.kinds[i].window for i in cfg.layer_kind_ids]
    return tuple(max_len if w is None else min(w + spare, max_len) for w in windows)


def cache_widths(cfg) -> tuple[int, int, int]:
    """(rows per batch row, k's width, v's width) of a layer's cache: (kv_heads, head_dim,
    head_dim), or for MLA (1, qk_rope_head_dim, kv_lora_rank): the rotated key and the
    latent."""
    if cfg.mla.on:
        return 1, cfg.mla.qk_rope_head_dim, cfg.mla.kv_lora_rank
    return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim


def kv_cache_bytes(cfg, batch: int, seq_len: int, dtype=None, windowed: bool = False) -> int:
    """(k's width + v's width) * rows (kv_heads, or 1 for MLA) * bytes per value * batch *
    the layers' slots (seq_len each, or a windowed layer's window: layer_slots); with
    dtype "int8", one byte per value plus two float32 scales per (row, slot)."""
    fmt = cache_format(dtype or cfg.dtype)
    rows, k_width, v_width = cache_widths(cfg)
    per_slot = fmt.entry_bytes(k_width) + fmt.entry_bytes(v_width)
    state_dtype = fmt.state_dtype(cfg.dtype)
    total = 0
    for i, slots in enumerate(layer_slots(cfg, seq_len, windowed)):
        own = cfg.recurrent_cache(i)
        if not recurrent_mixer(cfg, i):
            total += per_slot * rows * slots * batch
        if own is not None:  # a recurrent state: the same bytes at any length
            total += sum(math.prod(shape) * jnp.dtype(d or state_dtype).itemsize
                         for shape, d in own.values()) * batch
    return total


def recurrent_mixer(cfg, layer: int) -> bool:
    """Whether layer `layer`'s mixer is recurrent (no keys or values: its entries alone)."""
    return cfg.recurrent_cache(layer) is not None and not cfg.layer_parallels[layer]


def check_generates(cfg) -> None:
    """Refuses generation (a KV cache: generate, beam search, speculative decoding) for a
    model whose arch does not generate (jaxformer.model.archs: an encoder), in one line."""
    if not cfg.generates:
        raise ConfigError(f"model.arch={cfg.arch} has no generation (each token attends to the "
                          "whole row, after it too); use model.arch=decoder to generate")


def init_cache(cfg, batch: int, max_len: int, dtype=None, windowed: bool = False,
               spare: int = 0):
    """An empty cache for `batch` rows of up to `max_len` tokens. windowed: layers with a
    window shorter than max_len keep a ring of window + spare slots (unscanned layers
    only; spare >= T - 1 lets a chunk of T tokens be written and then taken back).
    dtype: the keys' and values' format (cache_formats.CACHE_FORMATS; int8: Quantised
    entries), default the model's dtype."""
    check_generates(cfg)
    fmt = cache_format(dtype or cfg.dtype)
    dtype = fmt.state_dtype(cfg.dtype)
    per_row, k_width, v_width = cache_widths(cfg)
    rows = batch * per_row
    def own(i, lead):  # a recurrent mixer's entries, each [*lead, batch, ...]
        return {n: jnp.zeros((*lead, batch, *shape), d or dtype)
                for n, (shape, d) in (cfg.recurrent_cache(i) or {}).items()}

    def keys(i, lead, s):  # an attention layer's keys and values, each [*lead, rows, s, H]
        if recurrent_mixer(cfg, i):
            return {}
        return {"k": fmt.empty((*lead, rows, s, k_width)),
                "v": fmt.empty((*lead, rows, s, v_width))}

    if cfg.scan_layers:
        if windowed:
            raise ValueError("a windowed KV cache needs unscanned layers (its layers differ in "
                             "size); use scan_layers=false, or windowed=False")
        layers = {r.name: {**keys(r.start, (r.length,), max_len), **own(r.start, (r.length,))}
                  for r in cfg.layer_runs}
    else:
        layers = {}
        for i, s in enumerate(layer_slots(cfg, max_len, windowed, spare)):
            layers[f"block_{i}"] = {**keys(i, (), s), **own(i, ())}
            if s < max_len and not recurrent_mixer(cfg, i):  # a ring: its slots' positions
                layers[f"block_{i}"]["positions"] = jnp.full((batch, s), EMPTY_SLOT, jnp.int32)
    return {"layers": layers, "positions": jnp.full((batch, max_len), EMPTY_SLOT, jnp.int32),
            "index": jnp.zeros([], jnp.int32)}


def has_rings(cache) -> bool:
    """Whether any layer of the cache is a ring (a windowed layer's)."""
    return cache is not None and any("positions" in layer for layer in cache["layers"].values())


def reads_pairs(cache) -> bool:
    """Whether a paged forward's cache (or one of its layers) is read by (row, page) pairs
    (jaxformer.attention.paged_cache.pair_attention)."""
    return cache is not None and PAIR_ENTRIES[0] in cache


def keys_own_positions(cache) -> bool:
    """Whether the cache's keys are not one row of slots per batch row (a ring's, a paged
    step's pairs'): a position bias is then made per layer from its own positions."""
    return has_rings(cache) or reads_pairs(cache)


def rolled_back(cache, end):
    """The cache as it was after its first `end` positions, for a cache whose slot is its
    position (each row decoded alone, as speculative decoding does): every slot holding
    position >= end emptied, in every layer's ring too, and `end` the next slot. What the
    emptied slots hold is overwritten before it is read again."""
    empty = lambda p: jnp.where(p >= end, EMPTY_SLOT, p)  # noqa: E731
    layers = {n: dict(layer, positions=empty(layer["positions"])) if "positions" in layer
              else layer for n, layer in cache["layers"].items()}
    return {"layers": layers, "positions": empty(cache["positions"]),
            "index": jnp.asarray(end, jnp.int32)}


def take_rows(cache, rows, n_kv_heads: int):
    """The cache of batch rows `rows` [R] (each owns n_kv_heads consecutive K/V rows; a
    ring's positions one row; a recurrent layer's entries one row each, unscanned)."""
    kv_rows = (rows[:, None] * n_kv_heads + jnp.arange(n_kv_heads)).reshape(-1)

    def take(layer):  # keys and values [(L,) R * K, S, H] (a scale's H: 1); a row's own
        return {name: jnp.take(x, rows, axis=0) if name in ROW_ENTRIES  # entries [R, ...]
                else jax.tree.map(lambda e: jnp.take(e, kv_rows, axis=-3), x)
                for name, x in layer.items()}

    return dict(cache, layers={n: take(layer) for n, layer in cache["layers"].items()},
                positions=jnp.take(cache["positions"], rows, axis=0))


def key_positions(cache, positions, segment_ids):
    """The cache's slot positions [B, S] with the new tokens' written at its index
    (padding, segment id 0, as EMPTY_SLOT: never attended to); a paged cache's
    (paged_positions) from its rows' starts and counts."""
    if "counts" in cache:
        return paged_positions(cache)
    new = positions if segment_ids is None else jnp.where(segment_ids != 0, positions,
                                                          EMPTY_SLOT)
    return jax.lax.dynamic_update_slice(cache["positions"], new, (0, cache["index"]))


def advanced(cache, layers, k_positions, t: int):
    """The cache after t tokens: their layers' keys/values and slot positions written."""
    return {"layers": layers, "positions": k_positions, "index": cache["index"] + t}


def write_layer(layer, k, v, index):
    """A layer's cache with k, v [B, T, K, H] written at slots [index, index + T) (the
    caller keeps that within S: dynamic_update_slice clamps, it does not grow); sharded as
    [B, K, S, H], rows over batch, then heads."""
    b, t, n_kv, _ = k.shape

    def update(cache, new):  # k's and v's widths may differ (MLA); a scale's is 1
        h = new.shape[-1]
        cache = jax.lax.dynamic_update_slice(
            cache, jnp.swapaxes(new, 1, 2).reshape(b * n_kv, t, h), (0, index, 0))
        return constrain(cache.reshape(b, n_kv, -1, h), "act_batch", "act_kv_heads",
                         "act_seq", "head_dim").reshape(cache.shape)

    return {name: jax.tree.map(update, layer[name], encoded(layer[name], new))
            for name, new in (("k", k), ("v", v))}


def write_ring(layer, k, v, k_positions):
    """A ring layer's cache with k, v [B, T, K, H] at positions k_positions [B, T]
    (EMPTY_SLOT: padding, not written) put in slots position % S; of several new tokens
    for one slot (T > S) the latest position is kept."""
    b, t, n_kv, _ = k.shape
    s = layer["positions"].shape[1]
    real = k_positions != EMPTY_SLOT
    slot = jnp.where(real, k_positions % s, s)  # slot s: out of range, dropped
    row = jnp.arange(b)[:, None]
    if t > 1:  # only each slot's latest position (a scatter-max has no order to depend on)
        latest = jnp.full((b, s + 1), -1, jnp.int32).at[row, slot].max(k_positions)
        slot = jnp.where(jnp.take_along_axis(latest, slot, 1) == k_positions, slot, s)

    def put(cache, new):  # cache [B * K, S, H] seen as [B, K, S, H]; new [B, T, K, H]
        c = cache.reshape(b, n_kv, s, -1).at[row, :, slot].set(new, mode="drop")
        return c.reshape(cache.shape)

    def entry(name, new):  # a Quantised entry's values and scales, each put in its slots
        return jax.tree.map(put, layer[name], encoded(layer[name], new))

    return {"k": entry("k", k), "v": entry("v", v),
            "positions": layer["positions"].at[row, slot].set(k_positions, mode="drop")}


def ring_keys(layer, k, v, k_positions):
    """A ring's keys and values [B * K, S + T, H] followed by the new tokens' (k, v
    [B, T, K, H]), and their positions [B, S + T]: what a chunk of T > 1 tokens attends
    over before it is written (its first queries may see keys the write replaces)."""
    b, t, n_kv, _ = k.shape
    rows = lambda x, new: jnp.concatenate(  # noqa: E731
        [x, jnp.swapaxes(new, 1, 2).reshape(b * n_kv, t, -1)], axis=1)

    def joined(x, new):  # a Quantised entry's values and scales, each joined
        return jax.tree.map(rows, x, encoded(x, new))

    return (joined(layer["k"], k), joined(layer["v"], v),
            jnp.concatenate([layer["positions"], k_positions], axis=1))


def as_keys(x, batch: int):
    """A layer's k or v [B * K, S, H] as [B, S, K, H], the layout every backend reads."""
    rows, s, h = x.shape
    return x.reshape(batch, rows // batch, s, h).swapaxes(1, 2)


def cached_attention(q, k, v, *, mask=None, bias=None, softcap=None, sinks=None):
    """Attention of q [B, T, N, H] over a layer's cache k, v [B * K, S, H] (a decode
    step): one row of slots per (batch row, K/V head), batch-major. softcap: the scaled
    logits s become softcap * tanh(s / softcap) before the bias and the mask; sinks [N]:
    attention sinks (jaxformer.core.reference)."""
    b, t, n, h = q.shape
    rows, s, _ = k.shape
    n_kv = rows // b
    g = n // n_kv
    q = q.reshape(b, t, n_kv, g, h).transpose(0, 2, 3, 1, 4).reshape(rows, g * t, h)
    logits = jnp.einsum("rqh,rsh->rqs", q, k, preferred_element_type=jnp.float32)
    logits = scale_and_mask(logits.reshape(b, n_kv, g, t, s), mask=mask, bias=bias,
                            scale=1.0 / math.sqrt(h), softcap=softcap)
    w = softmax(logits, group_sinks(sinks, n_kv)).reshape(rows, g * t, s)
    out = jnp.einsum("rqs,rsh->rqh", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    hv = v.shape[-1]
    out = out.reshape(b, n_kv, g, t, hv).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, Hv]
    return out.reshape(b, t, n, hv).astype(q.dtype)


# ---- a paged cache's key positions (jaxformer.attention.paged_cache) ---------------------

def paged_positions(cache):
    """A paged forward's key positions [R, M * page_size]: logical index j where the row
    holds it after the forward (j < starts + counts), else EMPTY_SLOT; read by (row, page)
    pairs (PAIR_ENTRIES), each pair's [P, page_size] (a padding pair's: EMPTY_SLOT)."""
    page_size = next((x["k"].shape[2] for x in cache["layers"].values() if "k" in x), 1)
    if reads_pairs(cache):
        held = jnp.take(cache["starts"] + cache["counts"], cache["pair_row"], mode="fill",
                        fill_value=0)
        j = cache["pair_index"][:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
        return jnp.where(j < held[:, None], j, EMPTY_SLOT)
    m = cache["page_table"].shape[1] * page_size
    j = jnp.arange(m, dtype=jnp.int32)
    return jnp.where(j < (cache["starts"] + cache["counts"])[:, None], j, EMPTY_SLOT)
