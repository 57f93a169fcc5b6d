"""The gated delta rule (Gated DeltaNet, the linear-attention mixer of Qwen3-Next): a
matrix-valued state S [Dk, Dv] per head that decays by exp(g_t) and is corrected towards
v_t at key k_t with strength beta_t at each token, read by the query:

    S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Two forms of the same map: `gated_delta_recurrent` (a scan over tokens, the decode step and
the reference) and `gated_delta_chunked` (the chunked parallel form: within a chunk the
delta updates are condensed into one unit-triangular solve, the WY / UT transform; a scan
over chunks carries the state), with work and memory linear in T.

Packing (segment_ids [B, T], None = one segment): a token of segment 0 is padding, which the
state passes unchanged (as if g = 0 and beta = 0; its output is not meant to be read); a
nonzero id that differs from the previous token's restarts from a zero state. The state
entering t = 0 is the given one, continued. Callers L2-normalise q and k and scale q.
"""

import jax.numpy as jnp
from jax import lax


def _compute_dtype(*xs):
    """float32, or float64 when an input is float64."""
    return jnp.promote_types(jnp.result_type(*[x for x in xs if x is not None]), jnp.float32)


def _segment_gates(segment_ids, batch: int, length: int):
    """(keep, reset) [B, T] bool: keep is False on padding (segment 0); reset is True where
    a nonzero segment id differs from the previous token's (never at t = 0)."""
    if segment_ids is None:
        return jnp.ones((batch, length), bool), jnp.zeros((batch, length), bool)
    seg = jnp.asarray(segment_ids)
    previous = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)  # [B, T]
    return seg != 0, (seg != 0) & (seg != previous)


def _prepared(q, k, v, g, beta, segment_ids, state):
    """Inputs in the compute dtype with padding folded into g and beta (pass-through), the
    reset flags [B, T] and the initial state [B, H, Dk, Dv] (zeros when None)."""
    dt = _compute_dtype(q, k, v, g, beta, state)
    b, t, h, dk = k.shape
    keep, reset = _segment_gates(segment_ids, b, t)
    q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
    g = g * keep[:, :, None]  # [B, T, H]
    beta = beta * keep[:, :, None]  # [B, T, H]
    if state is None:
        state = jnp.zeros((b, h, dk, v.shape[-1]), dt)
    return q, k, v, g, beta, reset, state.astype(dt)


def gated_delta_recurrent(q, k, v, g, beta, segment_ids=None, state=None):
    """The gated delta rule token by token (a lax.scan over T).

    q, k [B, T, H, Dk] (L2-normalised, q scaled), v [B, T, H, Dv], g [B, T, H] log decay
    (<= 0), beta [B, T, H] write strength in (0, 1), segment_ids [B, T] int or None,
    state [B, H, Dk, Dv] or None (zeros). Returns (out [B, T, H, Dv] in v's dtype, final
    state [B, H, Dk, Dv] in float32, or float64 for float64 inputs)."""
    out_dtype = v.dtype
    q, k, v, g, beta, reset, state = _prepared(q, k, v, g, beta, segment_ids, state)
    decay = jnp.where(reset[:, :, None], 0.0, jnp.exp(g))  # [B, T, H]: a reset zeroes S

    def step(s, xs):  # s [B, H, Dk, Dv]
        q_t, k_t, v_t, a_t, beta_t = xs  # [B, H, Dk], [B, H, Dk], [B, H, Dv], [B, H], [B, H]
        s = s * a_t[:, :, None, None]
        read = jnp.einsum("bhkv,bhk->bhv", s, k_t)  # [B, H, Dv]
        delta = beta_t[:, :, None] * (v_t - read)  # [B, H, Dv]
        s = s + k_t[:, :, :, None] * delta[:, :, None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)  # [B, H, Dv]

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, decay, beta)]  # [T, B, H, ...]
    state, out = lax.scan(step, state, time_major)
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), state  # [B, T, H, Dv]


def _chunked(x, chunk: int):
    """[B, T, H, ...] (T a multiple of chunk) -> [N, B, H, C, ...], chunk-major."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t // chunk, chunk, h, *x.shape[3:])  # [B, N, C, H, ...]
    return jnp.moveaxis(x, (1, 3), (0, 2))  # [N, B, H, C, ...]


def _masked_exp(x, mask):
    """exp(x) where mask, 0 elsewhere (no overflow, no NaN gradient from the masked part)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower triangular [..., C, C], by doubling: the inverses of
    the diagonal blocks of size s give those of size 2s, [[X1, 0], [-X2 L X1, X2]] with L
    the block below the diagonal (C is padded to a power of two with identity rows). Exact
    like forward substitution, in log2(C) rounds of small matmuls (XLA:CPU's batched
    triangular solve is 30x slower here, its gradient 10x)."""
    c = a.shape[-1]
    n = 1 << (c - 1).bit_length()
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, n - c), (0, n - c)])  # [..., n, n]
    inv = jnp.ones(a.shape[:-2] + (n, 1, 1), a.dtype)  # [..., n blocks, 1, 1]
    s = 1
    while s < n:
        m = n // (2 * s)  # blocks of size 2s
        below = a.reshape(a.shape[:-2] + (m, 2, s, m, 2, s))[..., :, 1, :, :, 0, :]
        below = jnp.einsum("...piqj,pq->...pij", below, jnp.eye(m, dtype=a.dtype))  # [..,m,s,s]
        pair = inv.reshape(inv.shape[:-3] + (m, 2, s, s))
        first, second = pair[..., 0, :, :], pair[..., 1, :, :]  # [..., m, s, s]
        corner = -jnp.einsum("...ij,...jk,...kl->...il", second, below, first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], -1)  # [..., m, s, 2s]
        inv = jnp.concatenate([top, jnp.concatenate([corner, second], -1)], -2)
        s *= 2
    return inv[..., 0, :c, :c]  # [..., C, C]


def _chunk_terms(q, k, v, g, beta, reset):
    """Each chunk's own terms, all chunks at once, so that for the state s entering a chunk
    its outputs are q_in @ s + out_in and the state leaving it transition @ s + write.
    Inputs [N, B, H, C, D] (g, beta [N, B, H, C], reset [N, B, 1, C]). Within a chunk the
    corrections are delta = u - w @ s, u and w from one unit-triangular system (the UT
    transform); the leaving state is decay * s + k_end^T @ delta."""
    c = g.shape[-1]
    gamma = jnp.cumsum(g, axis=-1)  # [N, B, H, C] log decay from the chunk's start
    run = jnp.cumsum(reset, axis=-1)  # [N, B, 1, C]: resets so far in the chunk
    carried = run == 0  # [N, B, 1, C]: the entering state still reaches the token
    causal = jnp.tril(jnp.ones((c, c), bool))  # [C, C], j <= i
    joint = (run[..., :, None] == run[..., None, :]) & causal  # [N, B, 1, C, C] same run
    pair = _masked_exp(gamma[..., :, None] - gamma[..., None, :], joint)  # [N, B, H, C, C]
    from_start = jnp.where(carried, jnp.exp(gamma), 0.0)  # [N, B, H, C]

    strict = pair * (1.0 - jnp.eye(c, dtype=pair.dtype))  # [N, B, H, C, C], j < i
    system = jnp.einsum("nbhid,nbhjd->nbhij", k, k) * strict * beta[..., :, None]
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * from_start)[..., None]], -1)
    solved = _unit_lower_inverse(system) @ rhs  # [N, B, H, C, Dv + Dk]
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]  # [N,B,H,C,Dv], [..,Dk]

    attn = jnp.einsum("nbhid,nbhjd->nbhij", q, k) * pair  # [N, B, H, C, C]
    q_in = q * from_start[..., None] - jnp.einsum("nbhij,nbhjd->nbhid", attn, w)
    out_in = jnp.einsum("nbhij,nbhjd->nbhid", attn, u)  # [N, B, H, C, Dv]
    to_end = pair[..., -1, :]  # [N, B, H, C]: decay from each token to the chunk's end
    k_end = k * to_end[..., None]  # [N, B, H, C, Dk]
    decay = from_start[..., -1, None, None]  # [N, B, H, 1, 1]: the whole chunk's decay
    transition = jnp.eye(k.shape[-1], dtype=k.dtype) * decay - jnp.einsum(
        "nbhck,nbhcl->nbhkl", k_end, w)  # [N, B, H, Dk, Dk]
    write = jnp.einsum("nbhck,nbhcv->nbhkv", k_end, u)  # [N, B, H, Dk, Dv]
    return q_in, out_in, transition, write


def gated_delta_chunked(q, k, v, g, beta, segment_ids=None, state=None, chunk=64):
    """The gated delta rule in its chunked parallel form: the same outputs and final state as
    `gated_delta_recurrent` (same arguments), by chunks of `chunk` tokens (T is padded to a
    multiple inside, with pass-through padding) and one lax.scan over chunks."""
    out_dtype = v.dtype
    q, k, v, g, beta, reset, state = _prepared(q, k, v, g, beta, segment_ids, state)
    b, t, h, _ = k.shape
    pad = -t % chunk

    def padded(x):  # zeros past T: g = 0, beta = 0 pass the state through
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    q, k, v, g, beta = (_chunked(padded(x), chunk) for x in (q, k, v, g, beta))
    reset = _chunked(padded(reset)[:, :, None], chunk)  # [N, B, 1, C]
    q_in, out_in, transition, write = _chunk_terms(q, k, v, g, beta, reset)

    def step(s, xs):  # s [B, H, Dk, Dv], the state entering the chunk
        a, w = xs  # [B, H, Dk, Dk], [B, H, Dk, Dv]
        return jnp.einsum("bhkl,bhlv->bhkv", a, s) + w, s

    state, entering = lax.scan(step, state, (transition, write))  # entering [N, B, H, Dk, Dv]
    out = jnp.einsum("nbhck,nbhkv->nbhcv", q_in, entering) + out_in  # [N, B, H, C, Dv]
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, t + pad, h, -1)  # [B, T', H, Dv]
    return out[:, :t].astype(out_dtype), state
