"""jaxformer.recurrent.conv: the causal depthwise convolution against a float64 loop over
its definition, with packed segments, and split into chunks with the cached tail."""

import numpy as np

from jaxformer.recurrent.conv import causal_conv


def reference(x, w, bias, seg):
    """y_t = bias + sum_j w[j] x_{t-(K-1)+j} over inputs of x_t's segment, in float64."""
    b, t, c = x.shape
    k = w.shape[0]
    y = np.zeros((b, t, c)) + bias
    for r in range(b):
        for i in range(t):
            for j in range(k):
                s = i - (k - 1) + j
                if s >= 0 and seg[r, s] == seg[r, i]:
                    y[r, i] += x[r, s] * w[j]
    return y


def test_conv_matches_its_definition_packed_and_split(rng):
    b, t, c, k = 2, 11, 3, 4
    x, w, bias = rng.normal(size=(b, t, c)), rng.normal(size=(k, c)), rng.normal(size=c)
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 2, [3] * 11])
    y, _ = causal_conv(x.astype(np.float32), w.astype(np.float32), bias.astype(np.float32), seg)
    real = seg != 0
    np.testing.assert_allclose(np.asarray(y)[real], reference(x, w, bias, seg)[real],
                               rtol=1e-5, atol=1e-5)
    # one segment, in pieces of 6 then 1 then 4 tokens: the tail carries the inputs between
    x1 = x[1:].astype(np.float32)
    whole = reference(x[1:], w, bias, np.ones((1, t), int))
    tail, outs = None, []
    for lo, hi in ((0, 6), (6, 7), (7, t)):
        y, tail = causal_conv(x1[:, lo:hi], w.astype(np.float32), bias.astype(np.float32),
                              None, tail)
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, 1), whole, rtol=1e-5, atol=1e-5)


def test_tail_skips_a_rows_trailing_padding(rng):
    """A right-padded prompt's tail holds its last K - 1 real inputs, as decoding needs."""
    x = rng.normal(size=(2, 6, 2)).astype(np.float32)
    seg = np.array([[1, 1, 1, 1, 0, 0], [1] * 6])
    _, tail = causal_conv(x, np.ones((3, 2), np.float32), None, seg)
    np.testing.assert_array_equal(np.asarray(tail[0]), x[0, 2:4])
    np.testing.assert_array_equal(np.asarray(tail[1]), x[1, 4:6])
