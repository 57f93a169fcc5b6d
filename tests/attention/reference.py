"""Float64 NumPy references, random inputs and compiled calls shared by the attention tests."""

# Everything is checked against literal textbook numbers or against the float64 NumPy
# references written here (masks, softmax, grouped-query attention), on fresh random
# inputs each run. Layout: q [B, Tq, N, H], k/v [B, Tk, K, H], masks [B, 1, Tq, Tk].

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention import backends, blockwise, chunked, dot_product_attention

# every backend that takes arrays and runs here (the table: a new entry is tested), but
# cuDNN: it takes 16-bit inputs alone, and these tests are float32 (bf16: test_backends.py)
BACKENDS = [n for n in backends.backends_here()
            if backends.BACKENDS[n].arrays is not None and n != "cudnn"]


# (query heads N, key/value heads K, Tq, Tk): every GQA ratio (K = N is MHA, K = 1 is MQA),
# self-attention (Tq = Tk) and decoding against a cache (Tq < Tk, query positions offset).
# Few distinct shapes, because each new one costs JAX a compilation.
CONFIGS = [(4, 4, 8, 8), (4, 2, 8, 8), (4, 2, 3, 8), (4, 1, 3, 8), (6, 3, 8, 8)]
B, H = 2, 8

# Every mask kind: "+" joins parts; windowW is sliding_window(W); alibi adds a bias.
MASK_KINDS = [
    "none",
    "causal",
    "padding",
    "packing",
    "window2",  # a window alone (no causal): everything ahead is allowed too
    "causal+window1",
    "causal+window3",
    "causal+window2+packing",
    "alibi",
    "causal+alibi",
    "packing+alibi",
]


# ---- float64 NumPy definitions -----------------------------------------------------


def np_causal(q_pos, k_pos):
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def np_window(q_pos, k_pos, window):
    return (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < window


def np_padding(q_seg, k_seg):
    return (q_seg[:, None, :, None] != 0) & (k_seg[:, None, None, :] != 0)


def np_segment(q_seg, k_seg):
    same = q_seg[:, None, :, None] == k_seg[:, None, None, :]
    return same & np_padding(q_seg, k_seg)


def np_attention(q, k, v=None, mask=None, bias=None, scale=None, softcap=None, sinks=None):
    """Float64 softmax(cap(q k^T * scale) + bias, where mask) [v]; K/V repeated per group;
    cap(s) = softcap * tanh(s / softcap) if softcap (Gemma 2), else s; sinks [N]: one more
    logit per head in every row's softmax, its weight dropped (gpt-oss).

    Returns the weights [B, N, Tq, Tk], and the output [B, Tq, N, H] when v is given.
    A row with no allowed key gets zero weights.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)  # query head n reads kv head n // group
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    peak = logits.max(axis=-1, keepdims=True)
    if sink is not None:
        peak = np.maximum(peak, sink)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(logits - peak)
    total = e.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - peak))
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    if v is None:
        return w
    v = np.repeat(np.asarray(v, np.float64), group, axis=2)
    return w, np.einsum("bnts,bsnh->btnh", w, v)


def np_index_causal(mask, t):
    causal = np.tril(np.ones((t, t), bool))[None, None]
    return causal if mask is None else mask & causal


def np_attention_grads(q, k, v, d_out, mask, bias, scale=None, softcap=None, sinks=None):
    """Float64 gradients of sum(attention(q, k, v) * d_out) for q, k, v and the bias, from
    the softmax's Jacobian row by row: dlogits = w * (dw - sum_keys(w * dw)). The bias's
    gradient is summed over the axes it broadcasts along. With a softcap, q and k get
    dlogits * (1 - tanh(s / softcap)^2), s = q k^T * scale; the bias dlogits itself. With
    sinks (a key whose dw is 0, weight w_sink = 1 - sum_keys(w)) also their gradient
    -sum_rows(w_sink * sum_keys(w * dw)), as a fifth value."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    w, _ = np_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                        softcap=softcap, sinks=sinks)  # [B, N, T, S]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    dw = np.einsum("btnh,bsnh->bnts", d_out, vr)
    d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))  # [B, N, T, S]
    ds = d_logits
    if softcap is not None:
        s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
        ds = d_logits * (1.0 - np.tanh(s / softcap) ** 2)
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    per_head = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], group, -1).sum(3)  # noqa: E731
    dk = per_head(np.einsum("bnts,btnh->bsnh", ds, q) * scale)
    dv = per_head(np.einsum("bnts,btnh->bsnh", w, d_out))
    axes = tuple(i for i in range(4) if np.shape(bias)[i] == 1)
    grads = dq, dk, dv, d_logits.sum(axis=axes, keepdims=True)
    if sinks is None:
        return grads
    row = np.sum(w * dw, axis=-1)  # [B, N, T]
    w_sink = 1.0 - w.sum(axis=-1)  # rows with no key: all their weight on the sink
    return grads + (-np.sum(w_sink * row, axis=(0, 2)),)


# ---- random inputs -----------------------------------------------------------------


def random_positions(rng, b, t):
    """Increasing positions with a random start and random gaps: [B, T]."""
    start = rng.integers(0, 50, size=(b, 1))
    return start + np.cumsum(rng.integers(1, 3, size=(b, t)), axis=1)


def padding_segments(rng, b, t):
    """Segment id 1 for a random-length prefix, then trailing zeros (padding)."""
    lengths = rng.integers(0, t, size=b)  # always some padding, sometimes all of it
    return (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)


def packed_segments(rng, b, t):
    """Random packing layouts: segments 1, 2, 3, ... of random lengths, then padding."""
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        used = int(rng.integers(t // 2, t + 1))
        n_cuts = int(rng.integers(0, min(3, used - 1) + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), size=n_cuts, replace=False))
        seg[i, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
    return seg


def positions_in_segments(seg):
    """Positions restart at 0 at each segment start (as packed training data has them)."""
    pos = np.zeros_like(seg)
    for i in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[i, t] = pos[i, t - 1] + 1 if seg[i, t] == seg[i, t - 1] else 0
    return pos


def alibi_like_bias(rng, q_pos, k_pos, n_heads):
    """-slope_n * |q - k| with random slopes, plus noise: [B, N, Tq, Tk] float32."""
    slopes = rng.uniform(0.05, 1.0, size=n_heads)
    dist = np.abs(q_pos[:, None, :, None] - k_pos[:, None, None, :])
    bias = -slopes[None, :, None, None] * dist + 0.1 * rng.normal(size=(1, n_heads, 1, 1))
    return bias.astype(np.float32)


def build_case(rng, kind, b, tq, tk, n_heads):
    """A NumPy mask [B, 1, Tq, Tk] (or None) and bias [B, N, Tq, Tk] (or None).

    Queries are the last Tq keys (positions and segments), so Tq < Tk is cached decoding.
    """
    parts = kind.split("+")
    k_pos, k_seg = random_positions(rng, b, tk), None
    if "padding" in parts:
        k_seg = padding_segments(rng, b, tk)
    if "packing" in parts:
        k_seg = packed_segments(rng, b, tk)
        k_pos = positions_in_segments(k_seg) + rng.integers(0, 5)
    q_pos = k_pos[:, tk - tq:]
    q_seg = None if k_seg is None else k_seg[:, tk - tq:]

    mask = np.ones((b, 1, tq, tk), bool)
    for part in parts:
        if part == "causal":
            mask &= np_causal(q_pos, k_pos)
        elif part.startswith("window"):
            mask &= np_window(q_pos, k_pos, int(part[len("window"):]))
        elif part == "padding":
            mask &= np_padding(q_seg, k_seg)
        elif part == "packing":
            mask &= np_segment(q_seg, k_seg)
    if set(parts) <= {"none", "alibi"}:
        mask = None
    bias = alibi_like_bias(rng, q_pos, k_pos, n_heads) if "alibi" in parts else None
    return mask, bias


def random_qkv(rng, b, tq, tk, n, kv, h=H, dtype=jnp.float32):
    q = rng.normal(size=(b, tq, n, h))
    k = rng.normal(size=(b, tk, kv, h))
    v = rng.normal(size=(b, tk, kv, h))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def as_jnp(mask, bias):
    return (None if mask is None else jnp.asarray(mask),
            None if bias is None else jnp.asarray(bias))


# ---- compiled calls -----------------------------------------------------------------
# The blockwise backend runs compiled, as a model runs it: called eagerly, each of its loops
# and conds is traced and compiled anew at every call. The others run eagerly unless asked
# (jit=True), their ops' programs cached per shape, which many cases share; a case of its
# own shapes compiles faster as one program. The inputs are arguments (a case's arrays are
# not baked into its program), so that cases of the same shapes share one program.


def _traced_settings(impl):
    """The module settings a backend reads when traced (blocks: the fixtures draw them per
    test), as a static argument: a cached program never serves another test's blocks."""
    return {"blockwise": (blockwise.BLOCK_Q, blockwise.BLOCK_K),
            "chunked": chunked.CHUNK}.get(impl)


def _compiled(fn, impl, jit):
    return fn if jit or (jit is None and impl == "blockwise") else fn.__wrapped__


_STATIC = ("impl", "is_causal", "scale", "softcap", "settings")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attend(q, k, v, mask, bias, *, impl, is_causal, scale, softcap, settings):
    del settings  # read by the backend from its module; here only to key the cache
    return dot_product_attention(q, k, v, mask=mask, bias=bias, impl=impl,
                                 is_causal=is_causal, scale=scale, softcap=softcap)


def attend(q, k, v, *, impl, mask=None, bias=None, is_causal=False, scale=None,
           softcap=None, jit=None):
    """dot_product_attention; jitted for blockwise or if jit."""
    return _compiled(_attend, impl, jit)(q, k, v, mask, bias, impl=impl, is_causal=is_causal,
                                         scale=scale, softcap=softcap,
                                         settings=_traced_settings(impl))


@functools.partial(jax.jit, static_argnames=_STATIC + ("argnums",))
def _attend_grads(q, k, v, mask, bias, d_out, *, argnums, impl, is_causal, scale, softcap,
                  settings):
    del settings

    def loss(q, k, v, bias):
        out = dot_product_attention(q, k, v, mask=mask, bias=bias, impl=impl,
                                    is_causal=is_causal, scale=scale, softcap=softcap)
        return jnp.sum(out * d_out), out

    return jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)


def attend_grads(q, k, v, d_out, *, impl, mask=None, bias=None, bias_grad=False,
                 is_causal=False, scale=None, softcap=None, jit=None):
    """The gradients of sum(dot_product_attention(...) * d_out) for q, k, v (and the bias
    if bias_grad), and the output: (grads, out); jitted for blockwise or if jit."""
    argnums = (0, 1, 2, 3) if bias_grad else (0, 1, 2)
    return _compiled(_attend_grads, impl, jit)(q, k, v, mask, bias, d_out, argnums=argnums,
                                               impl=impl, is_causal=is_causal, scale=scale,
                                               softcap=softcap,
                                               settings=_traced_settings(impl))
