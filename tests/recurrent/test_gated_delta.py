"""The gated delta rule (jaxformer.recurrent.gated_delta): the chunked form against the
float64 recurrence (outputs, final state, gradients) with packed segments, the recurrence
against transformers' Qwen3-Next one, packing against separate runs, and split calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.recurrent.gated_delta import gated_delta_chunked, gated_delta_recurrent

T = 37  # neither chunk below divides it
chunked = jax.jit(gated_delta_chunked, static_argnames="chunk")  # one compile per shape
recurrent = jax.jit(gated_delta_recurrent)
SEGMENTS = np.array([[1] * 9 + [2] * 12 + [0] * 5 + [3] * 11,  # a padding run, then a restart
                     [4] * 30 + [0] * 7])  # [B, T], one segment then padding to the end


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(rng, b=2, t=T, h=2, dk=8, dv=4):
    """Float64 (q, k, v, g, beta, state): q, k unit vectors (q scaled by dk^-1/2), g in
    [-0.1, 0] so the state lasts the sequence, beta in (0, 1)."""
    q = _unit(rng.standard_normal((b, t, h, dk))) * dk**-0.5
    k = _unit(rng.standard_normal((b, t, h, dk)))
    v = rng.standard_normal((b, t, h, dv))
    g = -0.1 * rng.random((b, t, h))
    beta = rng.uniform(0.05, 0.95, (b, t, h))
    return q, k, v, g, beta, rng.standard_normal((b, h, dk, dv))


def _f32(xs):
    return [np.asarray(x, np.float32) for x in xs]


def _assert_close(x, ref, tol, name=""):
    """|x - ref| <= tol * max|ref| (float32 against float64)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(x, ref, rtol=0, atol=tol * np.abs(ref).max(), err_msg=name)


def _value_and_grads(fn, weights, segments):
    """(out, state) and the gradients wrt q, k, v, g, beta, state of a random linear loss of
    out (padding's outputs left out) and the final state."""
    w_out, w_state = weights

    def loss(q, k, v, g, beta, state):
        out, final = fn(q, k, v, g, beta, segments, state)
        return jnp.sum(out * w_out) + jnp.sum(final * w_state), (out, final)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))


@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_equals_the_float64_recurrence_with_gradients(rng, chunk):
    xs = _inputs(rng)
    mask = (SEGMENTS != 0)[:, :, None, None]  # [B, T, 1, 1]: padding's outputs are not read
    weights = (rng.standard_normal(xs[2].shape) * mask, rng.standard_normal(xs[5].shape))
    with jax.enable_x64(True):
        grads_ref, (out_ref, state_ref) = _value_and_grads(
            gated_delta_recurrent, weights, SEGMENTS)(*xs)
        grads_ref, out_ref, state_ref = jax.device_get((grads_ref, out_ref, state_ref))
    chunked = _value_and_grads(lambda *a: gated_delta_chunked(*a, chunk=chunk),
                               _f32(weights), SEGMENTS)
    grads, (out, state) = chunked(*_f32(xs))
    assert out.dtype == jnp.float32 and state.dtype == jnp.float32
    assert np.isfinite(out).all()
    _assert_close(np.where(mask, out, 0), np.where(mask, out_ref, 0), 1e-5)
    _assert_close(state, state_ref, 1e-5)
    for name, grad, grad_ref in zip(["q", "k", "v", "g", "beta", "state"], grads, grads_ref):
        _assert_close(grad, grad_ref, 2e-5, name)


def test_recurrent_equals_transformers_qwen3_next(rng):
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    b, t, h, dk, dv = 2, 9, 2, 8, 4
    q, k = (rng.standard_normal((b, t, h, dk)).astype(np.float32) for _ in range(2))
    _, _, v, g, beta, state = _f32(_inputs(rng, b, t, h, dk, dv))
    want, want_state = qwen3_next.torch_recurrent_gated_delta_rule(
        *(torch.from_numpy(x) for x in (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
        output_final_state=True, use_qk_l2norm_in_kernel=True)

    def l2norm(x):  # transformers' (FLA's) eps
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    out, final = recurrent(l2norm(q) * dk**-0.5, l2norm(k), v, g, beta, state=state)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, want_state.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", [chunked, recurrent])
def test_packed_segments_equal_separate_runs(rng, form):
    """Row [A (continuing the given state), B (from zeros), padding] against A run alone
    from the state and B alone from zeros; the padding keeps B's final state."""
    q, k, v, g, beta, state = _f32(_inputs(rng, b=1, t=28))
    cut, end = 12, 24  # A = [0, 12), B = [12, 24), padding = [24, 28)
    segments = np.array([[7] * cut + [3] * (end - cut) + [0] * (28 - end)])
    out, final = form(q, k, v, g, beta, segments, state)
    a_out, _ = form(*(x[:, :cut] for x in (q, k, v, g, beta)), None, state)
    b_out, b_final = form(*(x[:, cut:end] for x in (q, k, v, g, beta)), None, 0 * state)
    _assert_close(out[:, :cut], a_out, 1e-5)
    _assert_close(out[:, cut:end], b_out, 1e-5)
    _assert_close(final, b_final, 1e-5)


def test_split_calls_carrying_the_state_equal_one_call(rng):
    """A prefill (chunked) then single-token steps (recurrent) then the rest (chunked), the
    state carried, equal one call over the packed row."""
    xs = _f32(_inputs(rng))
    state = xs[5]
    out, final = chunked(*xs[:5], SEGMENTS, state, chunk=8)
    pieces = []
    for lo, hi in [(0, 13), (13, 14), (14, 15), (15, 16), (16, 29), (29, T)]:
        # cuts inside segments (a call continues its state: no restart at its first token)
        form = recurrent if hi - lo < 13 else chunked
        piece, state = form(*(x[:, lo:hi] for x in xs[:5]), SEGMENTS[:, lo:hi], state)
        pieces.append(piece)
    mask = (SEGMENTS != 0)[:, :, None, None]
    _assert_close(np.where(mask, np.concatenate(pieces, 1), 0), np.where(mask, out, 0), 1e-5)
    _assert_close(state, final, 1e-5)
