"""jaxformer.core.logprobs against a float64 NumPy log-softmax gather: target_logprobs on
random logits and targets of any leading shape; token_logprobs on a stand-in model whose
forward returns fixed random logits, with and without packed segment ids (a segment's
first token and padding get 0)."""

import jax.numpy as jnp
import numpy as np

from jaxformer.core.logprobs import target_logprobs, token_logprobs


def np_logprobs(logits, targets):
    """log softmax(logits)[target] in float64."""
    x = np.asarray(logits, np.float64)
    peak = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - peak).sum(-1)) + peak[..., 0]
    return np.take_along_axis(x, targets[..., None], -1)[..., 0] - lse


def test_target_logprobs_is_a_log_softmax_gather(rng):
    for shape in [(5,), (2, 7), (2, 3, 4)]:
        v = int(rng.integers(2, 40))
        logits = (rng.normal(size=shape + (v,)) * rng.uniform(0.1, 20)).astype(np.float32)
        targets = rng.integers(0, v, size=shape)
        got = target_logprobs(jnp.asarray(logits, jnp.bfloat16 if len(shape) == 3
                                          else jnp.float32), jnp.asarray(targets))
        assert got.dtype == jnp.float32 and got.shape == shape
        if len(shape) == 3:  # bf16 logits are read as float32: the bf16 values' log-probs
            logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_allclose(got, np_logprobs(logits, targets), rtol=1e-5, atol=1e-5)
        assert (np.asarray(got) <= 1e-6).all()


class StandIn:
    """A model whose forward returns fixed logits and records what it was given."""

    def __init__(self, logits):
        self.logits, self.seen = logits, None

    def apply(self, variables, tokens, positions=None, segment_ids=None):
        self.seen = (variables, tokens, positions, segment_ids)
        return jnp.asarray(self.logits)


def packed(rng, b, t):
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        used = int(rng.integers(1, t + 1))
        cuts = np.sort(rng.choice(np.arange(1, t), size=2, replace=False))
        seg[i, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")[:used]
    return seg


def test_token_logprobs_aligns_each_token_with_the_logits_before_it(rng):
    b, t, v = 3, 9, 11
    logits = rng.normal(size=(b, t, v)).astype(np.float32) * 3
    tokens = rng.integers(0, v, size=(b, t))
    model = StandIn(logits)
    got = np.asarray(token_logprobs(model, {"w": 1}, jnp.asarray(tokens)))
    want = np.zeros((b, t))
    for i in range(b):
        for j in range(1, t):  # token j under the logits at j - 1
            want[i, j] = np_logprobs(logits[i, j - 1], tokens[i, j])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert model.seen[0] == {"params": {"w": 1}} and model.seen[2] is None

    seg = packed(rng, b, t)
    pos = rng.integers(0, t, size=(b, t))
    got = np.asarray(token_logprobs(model, {}, jnp.asarray(tokens), jnp.asarray(pos),
                                    jnp.asarray(seg)))
    assert model.seen[2] is not None and (np.asarray(model.seen[3]) == seg).all()
    for i in range(b):
        for j in range(t):
            inside = j > 0 and seg[i, j] != 0 and seg[i, j] == seg[i, j - 1]
            np.testing.assert_allclose(got[i, j], want[i, j] if inside else 0.0,
                                       rtol=1e-5, atol=1e-5, err_msg=f"{i}, {j}, {seg[i]}")
