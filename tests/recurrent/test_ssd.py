"""Mamba-2's SSD scan (jaxformer/recurrent/ssd.py): the chunked form against the float64 token by
token form (outputs, final state, gradients), against the paper's equations stepped in NumPy
and against transformers' Mamba-2 scan; packed rows and split calls against separate ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.recurrent.ssd import ssd_chunked, ssd_recurrent

BT, T, H, P, G, N = 2, 37, 4, 3, 2, 5  # 4 heads in 2 groups: heads 0, 1 read group 0


def draw(rng, length=T, batch=BT):
    """{x, dt, A, B, C, state (the initial one)} in that order, float64; dt and A small enough
    that the state keeps about a fifth of itself over T tokens."""
    return dict(x=rng.normal(size=(batch, length, H, P)),
                dt=rng.uniform(0.01, 0.15, (batch, length, H)),
                A=-rng.uniform(0.1, 1.0, H),
                B=rng.normal(size=(batch, length, G, N)),
                C=rng.normal(size=(batch, length, G, N)),
                state=rng.normal(size=(batch, H, P, N)))


def packed_ids():
    """[BT, T] segment ids: row 0 holds three segments with a padding run (id 0) inside; row 1
    one segment and trailing padding. Boundaries fall inside chunks of 8 and 16 and on one."""
    ids = np.ones((BT, T), np.int32)
    ids[0, 11:16], ids[0, 16:20], ids[0, 20:] = 2, 0, 3
    ids[1, 30:] = 0
    return ids


def paper_scan(x, dt, A, B, C, ids, state):
    """The paper's recurrence stepped in float64 NumPy: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t per head (head h reads group h // (H // G)); an id-0 token leaves h as it is,
    a token whose nonzero id differs from the previous token's starts from h = 0."""
    h, y = state.copy(), np.zeros_like(x)
    for b, t, head in np.ndindex(x.shape[0], x.shape[1], H):
        g = head // (H // G)
        if ids[b, t] == 0:
            continue
        if t > 0 and ids[b, t] != ids[b, t - 1]:
            h[b, head] = 0
        h[b, head] = (np.exp(dt[b, t, head] * A[head]) * h[b, head]
                      + dt[b, t, head] * np.outer(x[b, t, head], B[b, t, g]))
        y[b, t, head] = h[b, head] @ C[b, t, g]
    return y, h


def loss(f, weights, ids):
    """((a random scalar of f's outputs on the tokens read (id != 0) and final state, (y, final
    state)), the scalar's gradients wrt x, dt, A, B, C and the initial state), jitted."""
    read = jnp.asarray(ids != 0)[..., None, None]

    def value(x, dt, A, B, C, state):
        y, s = f(x, dt, A, B, C, segment_ids=jnp.asarray(ids), state=state)
        y = jnp.where(read, y, 0)
        return jnp.sum(y * weights[0]) + jnp.sum(s * weights[1]), (y, s)

    return jax.jit(jax.value_and_grad(value, argnums=tuple(range(6)), has_aux=True))


chunked = jax.jit(ssd_chunked, static_argnames="chunk")


def close(got, want, tol):
    """got == want to within tol of want's largest magnitude."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("chunk", [8, 16])  # 16 does not divide T = 37
def test_chunked_matches_recurrent_in_float64(rng, chunk):
    """float32 chunked form == float64 token by token form: outputs, final state and the
    gradients of a random scalar wrt x, dt, A, B, C and the initial state."""
    ids, inputs = packed_ids(), draw(rng)
    weights = (rng.normal(size=(BT, T, H, P)), rng.normal(size=(BT, H, P, N)))
    with jax.enable_x64(True):
        truth = loss(ssd_recurrent, weights, ids)(*inputs.values())
    f32 = [jnp.asarray(v, jnp.float32) for v in inputs.values()]
    got = loss(functools.partial(ssd_chunked, chunk=chunk), weights, ids)(*f32)
    (_, (y, s)), grads = got
    (_, want), want_grads = truth
    assert y.dtype == jnp.float32 and s.dtype == jnp.float32
    # y, the final state and the 6 gradients (not the scalar: a sum that may cancel to ~0)
    for g, w in zip((y, s) + grads, want + want_grads):
        close(g, w, 2e-5)


def test_chunked_matches_paper_equations(rng):
    """The chunked form in float64 == the paper's recurrence stepped in NumPy (packed rows,
    groups, an initial state); its y keeps x's dtype."""
    ids, inputs = packed_ids(), draw(rng)
    want_y, want_s = paper_scan(**inputs, ids=ids)
    read = ids[..., None, None] != 0
    with jax.enable_x64(True):
        y, s = chunked(**inputs, segment_ids=jnp.asarray(ids), chunk=16)
        assert y.dtype == jnp.float64 and s.dtype == jnp.float64
    close(np.where(read, y, 0), np.where(read, want_y, 0), 1e-10)
    close(s, want_s, 1e-10)


def test_matches_transformers_mamba2_scan(rng):
    """ssd_chunked == transformers' Mamba-2 chunked scan (mamba2_chunk_scan, from an initial
    state, T not a multiple of its chunk) and one ssd_recurrent step == its decoding step
    (mamba2_selective_state_update); no D skip, dt given as is."""
    torch = pytest.importorskip("torch")
    from transformers.models.mamba2 import modeling_mamba2 as hf
    inputs = {k: np.asarray(v, np.float32) for k, v in draw(rng).items()}
    pt = {k: torch.from_numpy(v) for k, v in inputs.items()}
    want_y, want_s = hf.mamba2_chunk_scan(pt["x"], pt["dt"], pt["A"], pt["B"], pt["C"], 16,
                                          initial_states=pt["state"], return_final_states=True)
    y, s = chunked(**inputs, chunk=8)
    close(y, want_y.numpy(), 1e-5)
    close(s, want_s.numpy(), 1e-5)
    state = pt["state"].clone()  # the step updates it in place
    dt = pt["dt"][:, 0, :, None].expand(-1, -1, P)  # [Bt, H, P], as Mamba2Mixer passes it
    A = pt["A"][:, None, None].expand(-1, P, N)  # [H, P, N]
    want_step = hf.mamba2_selective_state_update(state, pt["x"][:, 0], dt, A, pt["B"][:, 0],
                                                 pt["C"][:, 0])
    one = {k: v[:, :1] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    y, s = ssd_recurrent(**one)
    close(y[:, 0], want_step.numpy(), 1e-5)
    close(s, state.numpy(), 1e-5)


def test_packed_row_equals_each_segment_alone(rng):
    """One row packing a segment (continuing a given state) and a second one, then padding, ==
    the first alone from that state and the second alone from zeros."""
    first, second = 13, 20
    inputs = draw(rng, length=first + second + 4, batch=1)
    ids = np.array([[1] * first + [2] * second + [0] * 4], np.int32)
    y, s = chunked(**inputs, segment_ids=jnp.asarray(ids), chunk=8)
    part = {k: v[:, :first] for k, v in inputs.items() if k not in ("A", "state")}
    y1, _ = chunked(**part, A=inputs["A"], state=inputs["state"], chunk=8)
    part = {k: v[:, first:first + second] for k, v in inputs.items() if k not in ("A", "state")}
    y2, s2 = chunked(**part, A=inputs["A"], chunk=8)
    close(y[:, :first], y1, 1e-5)
    close(y[:, first:first + second], y2, 1e-5)
    close(s, s2, 1e-5)


def test_split_calls_equal_one(rng):
    """Two calls over T split mid-segment, the first's final state given to the second, ==
    one call over T (packed rows)."""
    ids, inputs = packed_ids(), draw(rng)
    cut = 24  # inside row 0's third segment and row 1's first
    y, s = chunked(**inputs, segment_ids=jnp.asarray(ids), chunk=8)
    half = {k: v[:, :cut] for k, v in inputs.items() if k not in ("A", "state")}
    y1, s1 = chunked(**half, A=inputs["A"], state=inputs["state"],
                     segment_ids=jnp.asarray(ids[:, :cut]), chunk=8)
    half = {k: v[:, cut:] for k, v in inputs.items() if k not in ("A", "state")}
    y2, s2 = chunked(**half, A=inputs["A"], state=s1, segment_ids=jnp.asarray(ids[:, cut:]),
                     chunk=8)
    read = ids[..., None, None] != 0
    close(np.where(read, y, 0), np.where(read, np.concatenate([y1, y2], axis=1), 0), 1e-5)
    close(s, s2, 1e-5)
