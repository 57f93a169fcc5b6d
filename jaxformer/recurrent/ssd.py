"""Mamba-2's selective state space scan (SSD, "state space duality", Dao and Gu 2024).

Each head h carries a state S [P, N] through the sequence:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t

with x_t [P] the head's input, dt_t > 0 its step, A_h < 0 its decay rate and B_t, C_t [N] read
from group h // (H // G). Two forms compute the same outputs and final state: `ssd_recurrent`
steps token by token (the truth, and the decoding step), `ssd_chunked` is SSD's block form
(a quadratic, attention-like product inside each chunk, the states passed between chunks).

Packing (`segment_ids` [Bt, T], None = one segment): a token with id 0 is padding (the state
passes it unchanged, its output is not meant to be read); a token whose nonzero id differs from
the previous token's starts from a zero state. The state entering t=0 is `state` (zeros when
None), continued: t=0 never restarts.

The math runs in float32 (float64 for float64 inputs); y comes back in x's dtype, the state in
the computing dtype. The D skip, the gate and the norm are the caller's.
"""

import jax
import jax.numpy as jnp


def compute_dtype(x):
    """float64 for float64 inputs, float32 otherwise."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def restarts(segment_ids, length: int):
    """[Bt, T] bool: the tokens that start from a zero state (a nonzero id that differs from
    the previous token's; never t=0). All False when segment_ids is None."""
    if segment_ids is None:
        return jnp.zeros((1, length), bool)
    previous = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)  # [Bt, T]
    return (segment_ids != 0) & (segment_ids != previous)


def effective_dt(dt, segment_ids, dtype):
    """dt [Bt, T, H] in the computing dtype, 0 at padding tokens (id 0): the state passes them."""
    dt = dt.astype(dtype)
    if segment_ids is None:
        return dt
    return jnp.where((segment_ids != 0)[..., None], dt, 0)


def initial_state(state, shape, dtype):
    """The state entering t=0: the given one in the computing dtype, or zeros [Bt, H, P, N]."""
    return jnp.zeros(shape, dtype) if state is None else state.astype(dtype)


def by_group(t, groups: int):
    """[..., H, D] -> [..., G, H // G, D]: head h = g * (H // G) + r reads group g."""
    return t.reshape(*t.shape[:-2], groups, t.shape[-2] // groups, t.shape[-1])


def ssd_recurrent(x, dt, A, B, C, segment_ids=None, state=None):
    """Mamba-2's scan token by token (lax.scan over T): at each token the step of transformers'
    Mamba2Mixer when decoding (mamba2_selective_state_update, less its D skip).

    x [Bt, T, H, P], dt [Bt, T, H] (already softplus'd, biased and clamped), A [H] (negative),
    B, C [Bt, T, G, N], segment_ids [Bt, T] or None, state [Bt, H, P, N] or None (zeros).
    Returns (y [Bt, T, H, P] without the D skip, the final state [Bt, H, P, N])."""
    dtype = compute_dtype(x)
    bt, length, heads, p = x.shape
    groups, n = B.shape[-2:]
    dt = effective_dt(dt, segment_ids, dtype)  # [Bt, T, H]
    reset = jnp.broadcast_to(restarts(segment_ids, length), (bt, length))  # [Bt, T]
    s0 = initial_state(state, (bt, heads, p, n), dtype)
    A = A.astype(dtype)

    def step(s, inputs):
        x_t, dt_t, b_t, c_t, reset_t = inputs  # [Bt, H, P], [Bt, H], [Bt, G, N] x2, [Bt]
        s = jnp.where(reset_t[:, None, None, None], 0, s)  # [Bt, H, P, N]
        s = (s * jnp.exp(dt_t * A)[..., None, None]).reshape(bt, groups, -1, p, n)  # [Bt,G,R,P,N]
        xdt = by_group(x_t * dt_t[..., None], groups)  # [Bt, G, R, P]
        s = s + jnp.einsum("bgrp,bgn->bgrpn", xdt, b_t)
        y_t = jnp.einsum("bgrpn,bgn->bgrp", s, c_t)  # [Bt, G, R, P]
        return s.reshape(bt, heads, p, n), y_t.reshape(bt, heads, p)

    inputs = (x.astype(dtype), dt, B.astype(dtype), C.astype(dtype), reset)
    final, y = jax.lax.scan(step, s0, jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), inputs))
    return jnp.moveaxis(y, 0, 1).astype(x.dtype), final  # [Bt, T, H, P]


def chunks(t, chunk: int):
    """[Bt, T, ...] -> [Bt, T / chunk, chunk, ...] (T a multiple of chunk)."""
    return t.reshape(t.shape[0], t.shape[1] // chunk, chunk, *t.shape[2:])


def pad_time(t, pad: int, value=0):
    """[Bt, T, ...] padded with `pad` tokens of `value` at the end of T."""
    return jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2), constant_values=value)


def runs(reset, chunk: int):
    """The run index of each token (how many restarts up to it) [Bt, c, L], and that of the
    token before each chunk [Bt, c] (0 before the first): two tokens share a state's history
    exactly when their run indices agree."""
    run = chunks(jnp.cumsum(reset, axis=1, dtype=jnp.int32), chunk)  # [Bt, c, L]
    before = jnp.concatenate([jnp.zeros_like(run[:, :1, 0]), run[:, :-1, -1]], axis=1)
    return run, before  # [Bt, c, L], [Bt, c]


def masked_exp(exponent, mask):
    """exp(exponent) where mask, else 0, with no overflow (nor NaN gradient) where not."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0)), 0)


def chunk_states(x, B, cum, run, groups: int):
    """Each chunk's own end state, as if it began from zeros [Bt, c, H, P, N]: the tokens in
    the chunk's last run, decayed to its end. x already times dt [Bt, c, L, H, P]."""
    to_end = masked_exp(cum[:, :, -1:] - cum, (run == run[:, :, -1:])[..., None])  # [Bt, c, L, H]
    xw = by_group(x * to_end[..., None], groups)  # [Bt, c, L, G, R, P]
    states = jnp.einsum("bclgrp,bclgn->bcgrpn", xw, B)  # [Bt, c, G, R, P, N]
    return states.reshape(*states.shape[:2], -1, *states.shape[-2:])  # [Bt, c, H, P, N]


def pass_states(states, decay, s0):
    """The state entering each chunk [Bt, c, H, P, N] and the final one [Bt, H, P, N]: a scan
    over chunks of S <- S * decay_c + states_c (decay [Bt, c, H]: the whole chunk's, 0 when it
    restarts)."""
    def step(s, inputs):
        local, d = inputs  # [Bt, H, P, N], [Bt, H]
        return s * d[..., None, None] + local, s

    inputs = (jnp.moveaxis(states, 1, 0), jnp.moveaxis(decay, 1, 0))  # chunks first
    final, entering = jax.lax.scan(step, s0, inputs)
    return jnp.moveaxis(entering, 0, 1), final


def intra_chunk(x, B, C, cum, run, groups: int):
    """The outputs from the chunk's own tokens [Bt, c, L, H, P]: y_l = sum over s <= l in the
    same run of (C_l . B_s) exp(cum_l - cum_s) dt_s x_s (x already times dt)."""
    length = cum.shape[2]
    causal = jnp.tril(jnp.ones((length, length), bool))  # [L, S]
    same = causal & (run[..., :, None] == run[..., None, :])  # [Bt, c, L, S]
    cum_h = jnp.moveaxis(cum, -1, 2)  # [Bt, c, H, L]
    decay = masked_exp(cum_h[..., :, None] - cum_h[..., None, :], same[:, :, None])  # [Bt,c,H,L,S]
    decay = decay.reshape(*decay.shape[:2], groups, -1, length, length)  # [Bt, c, G, R, L, S]
    scores = jnp.einsum("bclgn,bcsgn->bcgls", C, B)  # [Bt, c, G, L, S]
    weights = decay * scores[:, :, :, None]  # [Bt, c, G, R, L, S]
    y = jnp.einsum("bcgrls,bcsgrp->bclgrp", weights, by_group(x, groups))  # [Bt, c, L, G, R, P]
    return y.reshape(*y.shape[:3], -1, y.shape[-1])  # [Bt, c, L, H, P]


def from_entering(C, entering, cum, valid, groups: int):
    """The outputs from the state entering each chunk [Bt, c, L, H, P]: C_l . S exp(cum_l),
    for the tokens with no restart since the chunk began (valid [Bt, c, L])."""
    s = entering.reshape(*entering.shape[:2], groups, -1, *entering.shape[-2:])  # [Bt,c,G,R,P,N]
    y = jnp.einsum("bclgn,bcgrpn->bclgrp", C, s)  # [Bt, c, L, G, R, P]
    y = y.reshape(*y.shape[:3], -1, y.shape[-1])  # [Bt, c, L, H, P]
    return y * masked_exp(cum, valid[..., None])[..., None]


def ssd_chunked(x, dt, A, B, C, segment_ids=None, state=None, chunk=256):
    """The same outputs and final state as `ssd_recurrent`, by SSD's chunked form: within a
    chunk a masked quadratic product (decay exp(cum_l - cum_s) between tokens of one run),
    between chunks the states passed by a scan; work and memory linear in T. T need not be a
    multiple of chunk (padded inside with tokens that leave the state as it is)."""
    dtype = compute_dtype(x)
    bt, length, heads, p = x.shape
    groups, n = B.shape[-2:]
    chunk = min(chunk, length)
    pad = -length % chunk
    dt = effective_dt(dt, segment_ids, dtype)  # [Bt, T, H]
    reset = jnp.broadcast_to(restarts(segment_ids, length), (bt, length))  # [Bt, T]
    xdt = x.astype(dtype) * dt[..., None]  # [Bt, T, H, P]
    xdt, B, C = (chunks(pad_time(t.astype(dtype), pad), chunk) for t in (xdt, B, C))
    cum = jnp.cumsum(chunks(pad_time(dt * A.astype(dtype), pad), chunk), axis=2)  # [Bt,c,L,H]
    run, before = runs(pad_time(reset, pad, False), chunk)  # [Bt, c, L], [Bt, c]
    valid = run == before[..., None]  # [Bt, c, L]: the entering state still reaches the token
    decay = masked_exp(cum[:, :, -1], valid[:, :, -1:])  # [Bt, c, H]
    s0 = initial_state(state, (bt, heads, p, n), dtype)
    entering, final = pass_states(chunk_states(xdt, B, cum, run, groups), decay, s0)
    y = intra_chunk(xdt, B, C, cum, run, groups) + from_entering(C, entering, cum, valid, groups)
    y = y.reshape(bt, -1, heads, p)[:, :length]  # [Bt, T, H, P]
    return y.astype(x.dtype), final
