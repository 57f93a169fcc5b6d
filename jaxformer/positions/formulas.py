"""Positional encodings as plain functions of arrays.

Every scheme reads explicit integer positions ``[batch, seq]`` (default ``arange``), so
packed, padded and cached sequences all get the right ones:

- sinusoidal, learned: absolute, added to the token embeddings (``sinusoidal`` here; the
  learned table is an ``nn.Embed`` in the model);
- rope: rotates queries and keys inside attention (``apply_rope``; its scalings:
  jaxformer.positions.rope_scaling);
- alibi: a per-head linear distance bias on the attention logits (``alibi_bias``);
- t5: a learned bias per head and bucket of relative position (``relative_position_bucket``,
  ``t5_bias``);
- fire: a learned MLP of the normalised log distance (``fire_distance``; the MLP is
  ``jaxformer.model.self_attention.PositionBias``);
- none: nothing (NoPE; the causal mask alone carries order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.positions.rope_scaling import RopeScaling, rope_frequencies


def sinusoidal(positions, d_model: int, *, base: float = 10000.0, dtype=jnp.float32):
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)).

    positions: integer array of any shape [...]; returns [..., d_model] (sin and cos
    interleaved, as in Vaswani et al. 2017).
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    inv_freq = jnp.asarray(base ** (-np.arange(0, d_model, 2) / d_model), jnp.float32)  # [d/2]
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., d/2]
    pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)  # [..., d/2, 2]
    return pe.reshape(*positions.shape, d_model).astype(dtype)


def segment_positions(segment_ids):
    """Positions that restart at 0 at the start of every segment of a packed row.

    segment_ids: [batch, seq] ints (0 = padding); returns [batch, seq] int32.
    """
    seq = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    prev = jnp.concatenate([jnp.full_like(segment_ids[..., :1], -1), segment_ids[..., :-1]], -1)
    starts = jnp.where(segment_ids != prev, idx, 0)
    return idx - jax.lax.cummax(starts, axis=starts.ndim - 1)


# ---- RoPE -------------------------------------------------------------------------

def rotary_dims(head_dim: int, fraction: float = 1.0) -> int:
    """How many of a head's dimensions RoPE rotates: int(head_dim * fraction), as
    GPT-NeoX's rotary_ndims and HF's partial_rotary_factor."""
    return int(head_dim * fraction)


def kept_frequencies(rot: int, p: float = 1.0) -> int:
    """p-RoPE (Barbero et al. 2024): how many of the rot/2 frequencies keep rotating, the
    highest, int(p * rot // 2) as Gemma's rope_proportion; the lowest are set to 0 (those
    pairs pass through)."""
    return int(p * rot // 2)


def rope_tables(positions, head_dim: int, *, theta: float = 10000.0,
                scaling: RopeScaling | None = None, fraction: float = 1.0, p: float = 1.0,
                scale=None):
    """cos and sin tables [B, T, 1, head_dim] float32 for `rotate`: over the first
    rotary_dims(head_dim, fraction) dimensions [cos, cos] and [-sin, sin] (times the
    attention factor, and times `scale` [B, T, 1, rot/2] if given: xPos), over the rest 1
    and 0. p: p-RoPE's share of the frequencies kept (kept_frequencies)."""
    rot = rotary_dims(head_dim, fraction)
    inv_freq, attention_factor = rope_frequencies(rot, theta, scaling)
    inv_freq = np.where(np.arange(rot // 2) < kept_frequencies(rot, p), inv_freq, 0.0)
    angle = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angle) * attention_factor  # [B, T, 1, rot/2]
    sin = jnp.sin(angle) * attention_factor
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    # Full-width tables, x * [cos, cos] + [x2, x1] * [-sin, sin]: the same products and
    # sums as the split form. Written with the halves, XLA:CPU fused cos and sin into every
    # layer's rotation and recomputed them per element (~8% of a Llama-shaped train step);
    # through the concatenated tables they are computed once
    # (tests/model/test_transformer.py::test_rope_angles_are_computed_once_per_step).
    cos, sin = [cos, cos], [-sin, sin]
    if rot < head_dim:  # partial rotary: the other dimensions pass through
        rest = angle.shape[:-1] + (head_dim - rot,)
        cos, sin = cos + [jnp.ones(rest)], sin + [jnp.zeros(rest)]
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


XPOS_GAMMA = 0.4          # xPos's zeta_i = (2i / d + gamma) / (1 + gamma)
XPOS_SCALE_BASE = 512.0   # ... raised to the power position / scale_base
XPOS_MAX_POSITION = 32768  # zeta_0^(+-position / 512) stays within float32 up to here


def xpos_scale(positions, rot: int, keys: bool = False):
    """xPos's scale (Sun et al. 2022) of rotated pair i at position n: zeta_i^(n / 512) for
    queries, zeta_i^(-n / 512) for keys, so that q_n.k_m gains zeta_i^((n - m) / 512) <= 1
    for m <= n: a decay with distance, slowest for the highest frequency. [B, T, 1, rot/2]
    float32. Uncentred positions (the paper's code centres them, which cancels in q.k):
    exact while |n| <= XPOS_MAX_POSITION."""
    zeta = (np.arange(0, rot, 2) + XPOS_GAMMA * rot) / ((1 + XPOS_GAMMA) * rot)  # [rot/2]
    power = positions.astype(jnp.float32)[:, :, None, None] / XPOS_SCALE_BASE
    return jnp.exp((-power if keys else power) * jnp.asarray(np.log(zeta), jnp.float32))


def no_rope_tables(positions, head_dim: int):
    """The tables of no rotation (a NoPE layer among rotary ones): cos 1, sin 0."""
    shape = positions.shape + (1, head_dim)
    return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def rotate(x, cos, sin, rot: int | None = None):
    """x [B, T, N, H] rotated by the tables of rope_tables: dimension i pairs with
    i + rot/2 among the first rot (default all H); computed in float32, x's dtype out."""
    rot = x.shape[-1] if rot is None else rot
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :rot // 2], xf[..., rot // 2:rot], xf[..., rot:]
    swapped = jnp.concatenate([x2, x1] + ([rest] if rest.shape[-1] else []), axis=-1)
    return (xf * cos + swapped * sin).astype(x.dtype)


def apply_rope(x, positions, *, theta: float = 10000.0, scaling: RopeScaling | None = None,
               fraction: float = 1.0):
    """Rotate x [batch, seq, heads, head_dim] by its positions [batch, seq].

    Half-rotation layout (HF Llama / GPT-NeoX): dimension i pairs with i + rot/2, rot =
    the rotated dimensions (all of them unless fraction < 1, as GPT-NeoX's rotary_pct).
    Angles and the rotation are computed in float32; the result has x's dtype.
    """
    cos, sin = rope_tables(positions, x.shape[-1], theta=theta, scaling=scaling, fraction=fraction)
    return rotate(x, cos, sin, rotary_dims(x.shape[-1], fraction))


# ---- ALiBi ------------------------------------------------------------------------

def alibi_slopes(n_heads: int) -> np.ndarray:
    """Per-head slopes of Press et al. (2022), float64 [n_heads].

    For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ...
    Otherwise the reference takes the slopes of the nearest lower power of two, then
    every other slope of the next power of two (the interleaving of the paper's code).
    """
    if n_heads < 1:
        raise ValueError(f"alibi_slopes needs n_heads >= 1, got {n_heads}")

    def power_of_2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_2(closest)
    if closest != n_heads:
        slopes += power_of_2(2 * closest)[0::2][: n_heads - closest]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(slopes, q_positions, k_positions):
    """ALiBi logit bias -m_h * |i - j|: [batch, heads, q_len, k_len] float32.

    slopes: [heads]; q_positions: [batch, q_len]; k_positions: [batch, k_len].
    """
    distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None]


# ---- T5 relative buckets --------------------------------------------------------------

def relative_position_bucket(relative_position, *, bidirectional: bool = False,
                             num_buckets: int = 32, max_distance: int = 128):
    """T5's bucket of relative_position = key position - query position (int32).

    Unidirectional (a decoder): only keys at or before the query count, distance =
    max(-relative_position, 0). The first half of the buckets hold the distances
    0 .. num_buckets/2 - 1 one each; the rest are log-spaced up to max_distance, and every
    farther distance shares the last bucket. Bidirectional: half the buckets for keys
    after the query. The log is taken in float32 and truncated toward zero, as in Hugging
    Face's T5 (tests/positions/test_formulas.py checks every distance against it).
    """
    rel = jnp.asarray(relative_position, jnp.int32)
    offset = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        offset = (rel > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(rel)
    else:
        distance = -jnp.minimum(rel, 0)
    exact = num_buckets // 2
    far = jnp.maximum(distance, exact).astype(jnp.float32)  # log >= 0 where it is used
    log_bucket = exact + (jnp.log(far / exact) / math.log(max_distance / exact)
                          * (num_buckets - exact)).astype(jnp.int32)
    log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
    return offset + jnp.where(distance < exact, distance, log_bucket)


def t5_bias(table, q_positions, k_positions, *, max_distance: int = 128,
            bidirectional: bool = False):
    """T5's logit bias: [batch, heads, q_len, k_len] float32, a decoder's (unidirectional
    buckets) or with `bidirectional` an encoder's.

    table: [num_buckets, heads], a learned scalar per bucket and head; positions
    [batch, q_len] and [batch, k_len].
    """
    buckets = relative_position_bucket(k_positions[:, None, :] - q_positions[:, :, None],
                                       bidirectional=bidirectional,
                                       num_buckets=table.shape[0], max_distance=max_distance)
    return jnp.moveaxis(jnp.take(table.astype(jnp.float32), buckets, axis=0), -1, 1)


# ---- FIRE -----------------------------------------------------------------------------

FIRE_THRESHOLD = 512.0  # the initial L of FIRE's max(L, i); learned as a multiple of it
FIRE_EPS = 1e-6


def fire_distance(q_positions, k_positions, c, threshold):
    """FIRE's input: psi(i - j) / psi(max(L, i)), psi(x) = log(|c x| + 1), float32
    [batch, q_len, k_len] (Li et al. 2023, eq. 3 and their progressive interpolation).

    i is the query's position, j the key's; c > 0 and the threshold L are learned. Beyond
    L the distances are rescaled by the query's position, so a longer context maps into
    the range seen in training. Finite for any int32 positions (cache slots included).
    """
    q = q_positions.astype(jnp.float32)
    rel = q[:, :, None] - k_positions.astype(jnp.float32)[:, None, :]
    # log1p: log(x + 1) in float32 loses the digits of a small |c x| (c learned near 0)
    num = jnp.log1p(jnp.abs(c * rel))
    den = jnp.log1p(jnp.abs(c * jnp.maximum(q, threshold))) + FIRE_EPS
    return num / den[:, :, None]


# ---- KERPLE ----------------------------------------------------------------------------

KERPLE_EPS = 1e-2  # the reference code clamps r1, r2 to at least this after every step


def kerple_bias(r1, r2, q_positions, k_positions):
    """KERPLE's logarithmic kernel (Chi et al. 2022) as a logit bias, -r1 log(1 + r2 |i - j|):
    [batch, heads, q_len, k_len] float32. r1, r2: [heads], used as max(r, KERPLE_EPS): the
    reference code clamps them after each step, leaving the gradient of the clamped value
    to move them; so here the clamp passes the gradient through to r."""
    def clamped(r):
        r = r.astype(jnp.float32)
        return (r + jax.lax.stop_gradient(jnp.maximum(r, KERPLE_EPS) - r))[None, :, None, None]

    r1, r2 = clamped(r1), clamped(r2)
    distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    return -r1 * jnp.log1p(r2 * distance[:, None])


# ---- Sandwich ---------------------------------------------------------------------------

def sandwich_slopes(n_heads: int) -> np.ndarray:
    """Sandwich's per-head compensation, 1 / (8 h / n_heads) for h = 1..n_heads (NeMo's
    implementation), float64 [n_heads]."""
    return n_heads / (8.0 * np.arange(1, n_heads + 1))


def sandwich_bias(slopes, q_positions, k_positions, *, dims: int):
    """Sandwich (Chi et al. 2023) as a logit bias: the inner product of two sinusoidal
    embeddings of `dims` dimensions, which depends on the distance r = |i - j| alone,
    shifted to 0 at r = 0 and scaled per head:
    bias_h = slopes[h] * (sum_{k=1}^{dims/2} cos(r / 10000^(2k / dims)) - dims / 2).
    slopes: [heads] (sandwich_slopes). [batch, heads, q_len, k_len] float32."""
    inv_freq = 1.0 / 10000.0 ** (2.0 * np.arange(1, dims // 2 + 1) / dims)  # [dims/2]
    r = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
    total = jnp.cos(r[..., None] * jnp.asarray(inv_freq, jnp.float32)).sum(-1) - dims // 2
    return total[:, None] * jnp.asarray(slopes, jnp.float32)[None, :, None, None]
