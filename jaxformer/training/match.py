"""Task rewards inside jit (objective.reward=task:NAME in the GRPO step): a completion's
first line, surrounding ASCII whitespace stripped, compared byte for byte with a target,
on token ids. The same rule as jaxformer.training.rewards.first_line on decoded text.

The tokenizer's ids become bytes through a table (`byte_table`): a byte tokenizer's id is
its byte, a byte-level BPE's token its bytes (GPT-2's byte-to-unicode mapping undone), an
added token its text. Other tokenizers have no such table (`token_pieces` returns None)
and their rewards run on the host.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from jaxformer.data.tokenizer import ByteTokenizer
from jaxformer.training.rewards import WHITESPACE


def _byte_of_char() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE writes -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_pieces(tokenizer) -> list[bytes] | None:
    """Each id's bytes, such that decoding ids is decoding their concatenation; None when
    the tokenizer is not byte-level (its decode is more than concatenation)."""
    if getattr(tokenizer, "fingerprint", None) == ByteTokenizer.fingerprint:
        return [bytes([i]) for i in range(256)]
    hf = getattr(tokenizer, "hf", None)
    if hf is None or (json.loads(hf.to_str()).get("decoder") or {}).get("type") != "ByteLevel":
        return None
    added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
    byte_of = _byte_of_char()
    pieces = []
    for i in range(tokenizer.vocab_size):
        if i in added:
            pieces.append(added[i].encode())
            continue
        text = hf.id_to_token(i)
        if text is None or any(c not in byte_of for c in text):
            return None
        pieces.append(bytes(byte_of[c] for c in text))
    return pieces


def byte_table(pieces: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(bytes int32 [V, L] zero-padded, lengths int32 [V]) of `token_pieces`."""
    width = max(1, max(len(p) for p in pieces))
    table = np.zeros((len(pieces), width), np.int32)
    for i, p in enumerate(pieces):
        table[i, :len(p)] = list(p)
    return table, np.array([len(p) for p in pieces], np.int32)


def encode_targets(targets: list[str | None], width: int | None = None):
    """(bytes int32 [N, width] zero-padded, lengths int32 [N]; -1: no target, never equal)."""
    raw = [None if t is None else t.encode() for t in targets]
    width = width or max([1, *(len(r) for r in raw if r is not None)])
    out = np.zeros((len(raw), width), np.int32)
    lengths = np.full(len(raw), -1, np.int32)
    for i, r in enumerate(raw):
        if r is not None and len(r) <= width:
            out[i, :len(r)], lengths[i] = list(r), len(r)
    return out, lengths


def completion_bytes(tokens, counts, table, lengths, eot_id):
    """The bytes of each completion's first counts[i] tokens (a final eot_id dropped), left
    aligned: (bytes int32 [N, M * L], count int32 [N])."""
    n, m = tokens.shape
    live = jnp.arange(m)[None, :] < counts[:, None]
    if eot_id is not None:
        last = jnp.arange(m)[None, :] == counts[:, None] - 1
        live &= ~(last & (tokens == eot_id))
    width = jnp.where(live, lengths[tokens], 0)  # [N, M]
    start = jnp.cumsum(width, axis=1) - width
    cols = jnp.arange(table.shape[1])
    dest = jnp.where(cols < width[..., None], start[..., None] + cols, m * table.shape[1])
    rows = jnp.broadcast_to(jnp.arange(n)[:, None, None], dest.shape)
    out = jnp.zeros((n, m * table.shape[1]), jnp.int32).at[rows, dest].set(
        table[tokens], mode="drop")
    return out, jnp.sum(width, axis=1)


def first_line_equals(data, count, target, target_len):
    """1.0 where the first line of data[i, :count[i]] (surrounding WHITESPACE stripped)
    equals target[i, :target_len[i]], else 0.0: float32 [N]."""
    idx = jnp.arange(data.shape[1])[None, :]
    line_end = jnp.min(jnp.where((data == 10) & (idx < count[:, None]), idx,
                                 count[:, None]), axis=1)
    space = jnp.isin(data, jnp.array([ord(c) for c in WHITESPACE]))
    solid = ~space & (idx < line_end[:, None])
    start = jnp.min(jnp.where(solid, idx, line_end[:, None]), axis=1)
    end = jnp.max(jnp.where(solid, idx + 1, start[:, None]), axis=1)
    k = jnp.arange(target.shape[1])[None, :]
    got = jnp.take_along_axis(data, jnp.clip(start[:, None] + k, 0, data.shape[1] - 1), 1)
    same = jnp.all((got == target) | (k >= target_len[:, None]), axis=1)
    return ((end - start == target_len) & same).astype(jnp.float32)


def task_rewards(tokens, counts, table, lengths, eot_id, target, target_len):
    """The task reward of each completion (tokens [N, M] with counts [N] valid) against
    its encoded target: float32 [N]."""
    data, count = completion_bytes(tokens, counts, table, lengths, eot_id)
    return first_line_equals(data, count, target, target_len)
