"""Attention masks as rules on positions and segment ids: one definition, applied to a
whole [Tq, Tk] grid (make_attention_mask) or to one block of it (MaskRule.block), so that
blockwise attention never forms the grid.

Masks are bool, [B, 1, Tq, Tk] (True = may attend), and broadcast over heads.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


def causal_mask(q_positions, k_positions):
    """A query attends to keys at the same or earlier positions. -> [B, 1, Tq, Tk]"""
    return (k_positions[:, None, None, :] <= q_positions[:, None, :, None])


def padding_mask(q_segment_ids, k_segment_ids):
    """Segment id 0 marks padding: no query or key that is padding takes part. -> [B, 1, Tq, Tk]"""
    return (q_segment_ids[:, None, :, None] != 0) & (k_segment_ids[:, None, None, :] != 0)


def segment_mask(q_segment_ids, k_segment_ids):
    """Packing: attend only inside one's own segment; segment 0 (padding) never. -> [B, 1, Tq, Tk]"""
    same = q_segment_ids[:, None, :, None] == k_segment_ids[:, None, None, :]
    return same & padding_mask(q_segment_ids, k_segment_ids)


def sliding_window_mask(q_positions, k_positions, window: int):
    """Keys fewer than `window` positions behind the query (window 1 = itself). -> [B, 1, Tq, Tk]"""
    return (q_positions[:, None, :, None] - k_positions[:, None, None, :]) < window


def symmetric_window_mask(q_positions, k_positions, window: int):
    """Keys fewer than `window` positions from the query, either side (an encoder's
    window). -> [B, 1, Tq, Tk]"""
    return jnp.abs(q_positions[:, None, :, None] - k_positions[:, None, None, :]) < window


def chunk_mask(q_positions, k_positions, chunk):
    """Keys in the query's own chunk of `chunk` positions (position // chunk equal: Llama
    4's chunked local attention); a traced chunk of NO_WINDOW hides nothing. -> [B, 1, Tq, Tk]"""
    same = (q_positions[:, None, :, None] // chunk) == (k_positions[:, None, None, :] // chunk)
    return same if isinstance(chunk, int) else same | (chunk >= NO_WINDOW)


def make_attention_mask(q_positions, k_positions, q_segment_ids=None, k_segment_ids=None, *,
                        causal: bool = True, window: int | None = None, chunk=None):
    """The conjunction of the masks above that apply; without the causal rule a window is
    symmetric. -> [B, 1, Tq, Tk] bool"""
    mask = jnp.ones((q_positions.shape[0], 1, q_positions.shape[1], k_positions.shape[1]), bool)
    if causal:
        mask &= causal_mask(q_positions, k_positions)
    if window is not None:
        window_mask = sliding_window_mask if causal else symmetric_window_mask
        mask &= window_mask(q_positions, k_positions, window)
    if chunk is not None:
        mask &= chunk_mask(q_positions, k_positions, chunk)
    if q_segment_ids is not None:
        mask &= segment_mask(q_segment_ids, k_segment_ids)
    return mask


@flax.struct.dataclass
class MaskRule:
    """The mask as structure: positions [B, Tq] and [B, Tk], optional segment ids (0 =
    padding), and the static settings; a pytree whose arrays jit, scan and vmap carry.

    causal: keys at positions after the query's are hidden; False (an encoder) also makes
    the window symmetric (|q - k| < window).

    is_causal: also hide keys after the query's own index (self-attention, Tq = Tk): with
    position-causal masking this changes nothing for ordinary rows, and it lets a
    blockwise backend skip the upper triangle of blocks without looking at positions.
    by_index: the caller knows the positions are each row's indices (the model's default
    arange), so causal and window masks are by index too: what jax.nn.dot_product_attention's
    is_causal and local_window_size say, with no mask array.

    chunk: keys only in the query's chunk (chunk_mask; Llama 4's chunked layers, whose
    window is their chunk); layer_chunk: a traced one (scanned layer kinds), or None."""

    q_positions: jnp.ndarray
    k_positions: jnp.ndarray
    q_segment_ids: jnp.ndarray | None = None
    k_segment_ids: jnp.ndarray | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=True)
    window: int | None = flax.struct.field(pytree_node=False, default=None)
    is_causal: bool = flax.struct.field(pytree_node=False, default=False)
    by_index: bool = flax.struct.field(pytree_node=False, default=False)
    layer_window: jnp.ndarray | None = None  # a traced window (scanned layer kinds), or None
    chunk: int | None = flax.struct.field(pytree_node=False, default=None)
    layer_chunk: jnp.ndarray | None = None  # a traced chunk (scanned layer kinds), or None

    @property
    def any_window(self):
        """The window the rule applies: the static one, the traced one, or None."""
        return self.window if self.layer_window is None else self.layer_window

    @property
    def any_chunk(self):
        """The chunk the rule applies: the static one, the traced one, or None."""
        return self.chunk if self.layer_chunk is None else self.layer_chunk

    def block(self, q_start, q_len: int, k_start, k_len: int):
        """The mask of queries [q_start, +q_len) and keys [k_start, +k_len) (starts may
        be traced): [B, 1, q_len, k_len]."""
        take = lambda x, start, n: None if x is None else \
            jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)  # noqa: E731
        mask = make_attention_mask(
            take(self.q_positions, q_start, q_len), take(self.k_positions, k_start, k_len),
            take(self.q_segment_ids, q_start, q_len), take(self.k_segment_ids, k_start, k_len),
            causal=self.causal, window=self.any_window, chunk=self.any_chunk)
        if self.is_causal:
            rows = q_start + jnp.arange(q_len)[:, None]
            mask &= (k_start + jnp.arange(k_len)[None, :] <= rows)[None, None]
        return mask

    def dense(self):
        """The whole mask, [B, 1, Tq, Tk]."""
        return self.block(0, self.q_positions.shape[1], 0, self.k_positions.shape[1])


NO_WINDOW = 2**31 - 1  # a traced window that hides nothing: a global layer among local ones


def pick_rule(rules: tuple[MaskRule, ...], kind):
    """The mask rule of layer kind `kind` from one rule per kind (differing only in their
    window and chunk). kind is an int, or traced inside a scan over layers: then the kinds'
    windows (chunks) become data (layer_window, layer_chunk), and by_index is off (a
    by-index backend needs its window static)."""
    if not isinstance(kind, jax.Array):
        return rules[kind]
    table = lambda xs: jnp.asarray([NO_WINDOW if x is None else x for x in xs],  # noqa: E731
                                   jnp.int32)[kind]
    rule, windows, chunks = rules[0], [r.window for r in rules], [r.chunk for r in rules]
    if len(set(windows)) > 1:
        rule = rule.replace(window=None, layer_window=table(windows), by_index=False)
    if len(set(chunks)) > 1:  # the chunks likewise
        rule = rule.replace(chunk=None, layer_chunk=table(chunks), by_index=False)
    return rule
