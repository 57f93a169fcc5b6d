"""The Transformer (jaxformer.model.transformer: its blocks jaxformer.model.blocks, norms
jaxformer.model.norms, the kind tables jaxformer.model.kinds, per-layer patterns
jaxformer.model.layer_pattern) against a float64 NumPy forward pass, and its invariants."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer, stack_layers, unstack_layers
from jaxformer.attention.backends import BACKENDS, backends_here
from jaxformer.positions import segment_positions
from jaxformer.positions.schemes import POSITION_SCHEMES
from tests.conftest import DEFAULT_EMITTERS

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def small(**kw):
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def init(cfg, batch=2, seq=12):
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)))
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    # random (not init-time) norm scales and biases, so a swapped or missing one shows
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    if cfg.position == "fire":  # FIRE's threshold L (512 at init) inside the sequence, so
        # queries on both sides of it are tested
        params["position_bias"]["threshold_scale"] = jnp.float32(rng.uniform(1, 4) / 512)
        # and c (0.1 at init, either sign used) away from 0: there the distance is 0/0, and
        # c's float32 gradient the difference of two terms ~1/|c| (at c = -0.0012 the
        # reference and ring backends' gradients of c differed by 4%: CI drew it once)
        params["position_bias"]["c"] = jnp.float32(rng.choice([-1, 1]) * rng.uniform(0.03, 0.3))
    return tokens, params


def logits_of(cfg, params, tokens, **kw):
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens, **kw))


# ---- an independent float64 reference, written from the textbook formulas -------------

def keep(out, name, value):
    """value, recorded as out[name] when a dict of TransformerLens names is being filled
    (tests/model/test_inspect.py); out None records nothing."""
    if out is not None:
        out[name] = value
    return value


def np_norm(cfg, p, x, out=None, name=None):
    if cfg.norm == "rmsnorm":
        normalized = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
    else:
        mu = x.mean(-1, keepdims=True)
        normalized = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + cfg.norm_eps)
    return keep(out, name, normalized) * p["scale"] + p.get("bias", 0.0)


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_rope(x, pos, theta, p=1.0, xpos=None):  # HF Llama: x * cos + rotate_half(x) * sin
    """p: p-RoPE's share of frequencies kept (the highest, int(p * h // 2) of them, the rest
    0: Barbero et al. 2024 as Gemma's rope_proportion); xpos: 'q' or 'k' for xPos (Sun et
    al. 2022): pair i also scaled by zeta_i^(+-n / 512), zeta_i = (2i/h + 0.4) / 1.4."""
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    inv[int(p * h // 2):] = 0.0
    ang = pos[:, :, None, None] * np.concatenate([inv, inv])  # [B, T, 1, H]
    rot = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    out = x * np.cos(ang) + rot * np.sin(ang)
    if xpos is not None:
        zeta = (np.arange(0, h, 2) / h + 0.4) / 1.4
        power = pos[:, :, None, None] / 512.0 * (1 if xpos == "q" else -1)
        out = out * np.concatenate([zeta, zeta]) ** power
    return out


def np_cope_scores(cfg, q, k, embedding, allowed):
    """CoPE's logits [B, N, T, S] in float64 (Golovneva et al. 2024; the RAM reference
    code): gates sigmoid(q.k / sqrt(d)) on allowed keys, a key's position the sum of the
    gates from it to the query, clamped to P - 1, its embedding interpolated linearly."""
    raw = np.einsum("btnh,bsnh->bnts", q, k)
    d = math.sqrt(cfg.head_dim)
    gates = np.where(allowed[:, None], 1 / (1 + np.exp(-raw / d)), 0.0)
    pos = np.minimum(np.cumsum(gates[..., ::-1], -1)[..., ::-1], cfg.position_settings.positions - 1)
    lo, hi = np.floor(pos).astype(int), np.ceil(pos).astype(int)
    e_lo, e_hi = embedding.T[lo], embedding.T[hi]  # [B, N, T, S, H]
    e = e_lo + (pos - lo)[..., None] * (e_hi - e_lo)
    return (raw + np.einsum("btnh,bntsh->bnts", q, e)) / d


def np_dense(p, x, spec):
    return np.einsum(spec, x, p["kernel"]) + p.get("bias", 0.0)


def np_t5_bucket(cfg, distance, num_buckets=None):
    """T5's decoder bucket of a distance >= 0, from the textbook formula in float64
    (num_buckets: the model's, or an encoder's half of them for one side)."""
    num_buckets = num_buckets or cfg.position_settings.num_buckets
    exact = num_buckets // 2
    far = exact + np.floor(np.log(np.maximum(distance, exact) / exact)
                           / math.log(cfg.position_settings.max_distance / exact) * (num_buckets - exact))
    return np.where(distance < exact, distance, np.minimum(far, num_buckets - 1))


def np_t5_buckets(cfg, rel):
    """The bucket of each query - key distance `rel`: a decoder's (keys behind the query),
    or an encoder's (T5's bidirectional: the upper half of the buckets for keys ahead)."""
    if cfg.causal:
        return np_t5_bucket(cfg, np.maximum(rel, 0))
    half = cfg.position_settings.num_buckets // 2
    return (rel < 0) * half + np_t5_bucket(cfg, np.abs(rel), half)


def np_position_bias(cfg, p, pos):
    """The t5 or fire logit bias [B, N, T, T] in float64, or 0."""
    rel = pos[:, :, None] - pos[:, None, :]  # query - key
    if cfg.position == "t5":
        table = p["position_bias"]["relative_bias"]
        return np.moveaxis(table[np_t5_buckets(cfg, rel).astype(int)], -1, 1)
    if cfg.position == "fire":
        f = p["position_bias"]
        psi = lambda d: np.log(np.abs(f["c"] * d) + 1)  # noqa: E731
        threshold = np.abs(f["threshold_scale"] * 512.0)
        x = psi(rel) / (psi(np.maximum(threshold, pos))[:, :, None] + 1e-6)
        h = np.maximum(x[..., None] * f["hidden_kernel"] + f["hidden_bias"], 0)  # 1 -> 32, ReLU
        return np.moveaxis(h @ f["out_kernel"] + f["out_bias"], -1, 1)  # 32 -> heads
    distance = np.abs(rel)[:, None]  # [B, 1, T, S]
    if cfg.position == "kerple":  # -r1 log(1 + r2 |i - j|), r1, r2 clamped to >= 0.01
        r1, r2 = (np.maximum(p["position_bias"][n], 0.01)[None, :, None, None]
                  for n in ("r1", "r2"))
        return -r1 * np.log(1 + r2 * distance)
    if cfg.position == "alibi_power":  # -m_h |i - j|^p, m_h = 2^(-8h/N) (N a power of two)
        slopes = 2.0 ** (-8.0 * np.arange(1, cfg.n_heads + 1) / cfg.n_heads)
        return -slopes[:, None, None] * distance ** cfg.position_settings.power
    if cfg.position == "sandwich":  # sum_k cos(r / 10000^(2k/d)) - d/2, head h / (8h/N)
        d = cfg.head_dim
        total = sum(np.cos(distance / 10000.0 ** (2 * k / d)) for k in range(1, d // 2 + 1))
        return (total - d / 2) / (8 * np.arange(1, cfg.n_heads + 1) / cfg.n_heads)[:, None, None]
    return 0.0


def np_attention(cfg, p, x, pos, allowed, bias=0.0, out=None, pre=""):
    q = keep(out, pre + "hook_q", np_dense(p["query"], x, "btd,dnh->btnh"))
    k = keep(out, pre + "hook_k", np_dense(p["key"], x, "btd,dkh->btkh"))
    v = keep(out, pre + "hook_v", np_dense(p["value"], x, "btd,dkh->btkh"))
    if cfg.position in ("rope", "xpos"):
        xpos = cfg.position == "xpos"
        q = keep(out, pre + "hook_rot_q", np_rope(q, pos, cfg.rope_theta, cfg.p_rope,
                                                  "q" if xpos else None))
        k = keep(out, pre + "hook_rot_k", np_rope(k, pos, cfg.rope_theta, cfg.p_rope,
                                                  "k" if xpos else None))
    g = cfg.n_heads // cfg.n_kv_heads
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n uses kv head n // g
    s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(cfg.head_dim)
    if cfg.position == "cope":
        s = np_cope_scores(cfg, q, k, p["cope_embedding"], allowed)
    if cfg.position == "alibi":  # n_heads = 4: slopes 2^-2, 2^-4, 2^-6, 2^-8
        slopes = 2.0 ** (-2.0 * np.arange(1, 5))
        s = s - slopes[None, :, None, None] * np.abs(pos[:, None, :, None] - pos[:, None, None, :])
    s = s + bias
    s = keep(out, pre + "hook_attn_scores", np.where(allowed[:, None], s, -np.inf))
    m = np.max(s, -1, keepdims=True)
    sink = p["sinks"][None, :, None, None] if cfg.attn_sinks else -np.inf  # a key, value 0
    m = np.maximum(m, sink)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(-1, keepdims=True) + np.exp(sink - np.where(np.isfinite(m), m, 0))
    w = keep(out, pre + "hook_pattern", e / np.maximum(total, 1e-300))
    z = keep(out, pre + "hook_z", np.einsum("bnts,bsnh->btnh", w, v))
    return np.einsum("btnh,nhd->btd", z, p["out"]["kernel"]) + p["out"].get("bias", 0.0)


def np_ffn(cfg, p, x, out=None, pre=""):
    act = {"gelu": np_gelu, "geglu": np_gelu, "relu": lambda a: np.maximum(a, 0),
           "swiglu": lambda a: a / (1 + np.exp(-a)), "clamped_swiglu": None}[cfg.ffn]
    gated = cfg.ffn in ("swiglu", "geglu", "clamped_swiglu")
    h = keep(out, pre + "hook_pre", np_dense(p["wi_gate" if gated else "wi"], x, "btd,df->btf"))
    if gated:
        up = keep(out, pre + "hook_pre_linear", np_dense(p["wi_up"], x, "btd,df->btf"))
        if act is None:  # gpt-oss: gate clamped above at 7, up to [-7, 7]
            g = np.minimum(h, 7.0)
            h = (np.clip(up, -7.0, 7.0) + 1) * g / (1 + np.exp(-1.702 * g))
        else:
            h = act(h) * up
    else:
        h = act(h)
    return np_dense(p["wo"], keep(out, pre + "hook_post", h), "btf,fd->btd")


def np_sinusoidal_terms(cfg, x, pos):
    """The token embeddings x and the sinusoidal table, each scaled as the scheme's
    settings' scale says; the model's input is their sum."""
    i = np.arange(cfg.d_model // 2)
    ang = pos[..., None] / 10000.0 ** (2 * i / cfg.d_model)
    pe = np.zeros((*pos.shape, cfg.d_model))
    pe[..., 0::2], pe[..., 1::2] = np.sin(ang), np.cos(ang)
    scale = {"table": (1.0, 1 / math.sqrt(cfg.d_model)), "tokens": (math.sqrt(cfg.d_model), 1.0),
             "unit": (1.0, 1.0)}[cfg.position_settings.scale]
    return scale[0] * x, scale[1] * pe


def np_forward(cfg, params, tokens, positions=None, segment_ids=None, out=None):
    """Float64 logits; with a dict `out`, every TransformerLens-named activation too."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b, t = tokens.shape
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
    x = keep(out, "hook_embed", p["embed"]["embedding"][np.asarray(tokens)])
    if cfg.position == "learned":
        x = x + keep(out, "hook_pos_embed", p["pos_embed"]["embedding"][pos])
    elif cfg.position == "sinusoidal":
        x, table = np_sinusoidal_terms(cfg, x, pos)
        x = x + keep(out, "hook_pos_embed", table)
    ahead = pos[:, :, None] - pos[:, None, :]  # query - key, [B, Tq, Tk]
    allowed = ahead >= 0 if cfg.causal else np.ones_like(ahead, bool)  # an encoder: no rule
    if cfg.sliding_window:
        allowed &= (ahead if cfg.causal else np.abs(ahead)) < cfg.sliding_window
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        allowed &= (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    bias = np_position_bias(cfg, p, pos)  # one for every layer
    for i in range(cfg.n_layers):
        blk, pre = p[f"block_{i}"], f"blocks.{i}."

        def attn(h):
            return keep(out, pre + "hook_attn_out", np_attention(
                cfg, blk["attn"], h, pos, allowed, bias, out, pre + "attn."))

        def ffn(h):
            return keep(out, pre + "hook_mlp_out", np_ffn(cfg, blk["ffn"], h, out, pre + "mlp."))

        def norm(which, h, ln):
            return np_norm(cfg, blk[which], h, out, pre + ln + ".hook_normalized")

        x = keep(out, pre + "hook_resid_pre", x)
        if cfg.block == "pre_ln":
            x = keep(out, pre + "hook_resid_mid", x + attn(norm("attn_norm", x, "ln1")))
            x = x + ffn(norm("ffn_norm", x, "ln2"))
        else:
            x = keep(out, pre + "hook_resid_mid", norm("attn_norm", x + attn(x), "ln1"))
            x = norm("ffn_norm", x + ffn(x), "ln2")
        x = keep(out, pre + "hook_resid_post", x)
    if cfg.block == "pre_ln":
        x = np_norm(cfg, p["final_norm"], x, out, "ln_final.hook_normalized")
    if cfg.tie_embeddings:
        return x @ p["embed"]["embedding"].T
    return x @ p["lm_head"]["kernel"]


VARIANTS = {
    "gpt2": dict(position="learned", ffn="gelu"),
    "llama-gqa": dict(position="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2,
                      use_bias=False, tie_embeddings=False, rope_theta=500000.0),
    "mqa-geglu": dict(position="rope", ffn="geglu", n_kv_heads=1),
    "alibi-post-ln": dict(position="alibi", block="post_ln", ffn="relu"),
    "sinusoidal": dict(position="sinusoidal", norm="rmsnorm"),
    "sinusoidal-tokens-scaled": dict(position="sinusoidal", position_settings={"scale": "tokens"}),
    "sinusoidal-unit": dict(position="sinusoidal", position_settings={"scale": "unit"},
                            block="post_ln"),
    "t5-gqa": dict(position="t5", n_kv_heads=2,
                   position_settings={"num_buckets": 8, "max_distance": 20}),
    "t5-post-ln": dict(position="t5", block="post_ln",
                       position_settings={"num_buckets": 6, "max_distance": 9}),
    "fire-gqa": dict(position="fire", n_kv_heads=2, norm="rmsnorm", ffn="swiglu"),
    "nope-window": dict(position="none", sliding_window=3),
    "rope-window-headdim": dict(position="rope", head_dim=12, sliding_window=5),
    "xpos-gqa": dict(position="xpos", n_kv_heads=2),
    "p-rope": dict(position="rope", p_rope=0.5, head_dim=12),
    "kerple-post-ln": dict(position="kerple", block="post_ln"),
    "sandwich-window": dict(position="sandwich", sliding_window=5),
    "cope-gqa": dict(position="cope", n_kv_heads=2, position_settings={"positions": 5}),
    "qwen2-qkv-bias": dict(position="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2,
                           use_bias=False, qkv_bias=True),
    "gpt-oss-sinks": dict(position="rope", norm="rmsnorm", ffn="clamped_swiglu", n_kv_heads=2,
                          attn_sinks=True, sliding_window=4, tie_embeddings=False),
}


def test_qkv_bias_puts_biases_on_query_key_value_only():
    _, params = init(small(**VARIANTS["qwen2-qkv-bias"]))
    attn = params["block_0"]["attn"]
    assert all("bias" in attn[n] for n in ("query", "key", "value"))
    assert "bias" not in attn["out"] and "bias" not in params["block_0"]["ffn"]["wo"]
    assert small(use_bias=True).qkv_bias and not small(use_bias=False).qkv_bias


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_float64_reference(name):
    cfg = small(**VARIANTS[name])
    tokens, params = init(cfg)
    got = logits_of(cfg, params, tokens)
    assert got.dtype == np.float32 and got.shape == (*tokens.shape, cfg.vocab_size)
    np.testing.assert_allclose(got, np_forward(cfg, params, tokens), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "alibi-post-ln", "gpt2", "t5-gqa", "fire-gqa",
                                  "gpt-oss-sinks"])
def test_packed_matches_reference(name):
    cfg = small(**VARIANTS[name])
    tokens, params = init(cfg, batch=2, seq=12)
    seg = np.array([[1] * 5 + [2] * 4 + [3] * 3, [1] * 7 + [2] * 3 + [0] * 2])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    got = logits_of(cfg, params, tokens, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(got, np_forward(cfg, params, tokens, pos, seg), rtol=2e-4,
                               atol=2e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "alibi-post-ln", "t5-gqa", "fire-gqa",
                                  "nope-window", "gpt-oss-sinks"])
def test_blockwise_model_matches_reference_and_its_gradients(name, monkeypatch):
    """attention_impl='blockwise' gets the mask as positions and segment ids and the
    position bias as (fn, params), a block at a time: logits match the float64 reference
    on a packed batch with padding and ragged blocks, and every param's gradient (T5's
    table and FIRE's MLP through the bias) matches the reference backend's."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", int(rng.integers(2, 6)))
    monkeypatch.setattr(blockwise, "BLOCK_K", int(rng.integers(2, 6)))
    cfg = small(**VARIANTS[name], attention_impl="blockwise")
    t = int(rng.integers(9, 15))
    tokens, params = init(cfg, batch=2, seq=t)
    cuts = np.sort(rng.choice(np.arange(1, t), 2, replace=False))
    seg = np.stack([np.searchsorted(cuts, np.arange(t), side="right") + 1,
                    np.where(np.arange(t) < cuts[1], 1, 0)])  # packed; padded at the end
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    real = seg > 0
    w = jnp.asarray(rng.standard_normal((*seg.shape, cfg.vocab_size)) * real[..., None],
                    jnp.float32)

    @jax.jit
    def grads(params):  # blockwise's logits and gradient, and the reference backend's
        def loss(p, impl):
            logits = Transformer(cfg.replace(attention_impl=impl)).apply(
                {"params": p}, tokens, positions=pos, segment_ids=seg)
            return jnp.sum(w * logits), logits
        (_, logits), got = jax.value_and_grad(loss, has_aux=True)(params, "blockwise")
        return logits, got, jax.grad(lambda p: loss(p, "reference")[0])(params)

    got, got_g, want = grads(params)
    np.testing.assert_allclose(np.asarray(got)[real],
                               np_forward(cfg, params, tokens, pos, seg)[real],
                               rtol=2e-4, atol=2e-4)
    for path, g in jax.tree_util.tree_leaves_with_path(got_g):
        ref = functools.reduce(lambda x, k: x[k.key], path, want)
        np.testing.assert_allclose(g, ref, rtol=1e-3, atol=2e-5, err_msg=str(path))
    if cfg.position in ("t5", "fire"):
        assert float(jnp.abs(want["position_bias"][
            "relative_bias" if cfg.position == "t5" else "out_kernel"]).max()) > 0


@pytest.mark.parametrize("name", ["llama-gqa", "rope-window-headdim"])
def test_splash_model_matches_reference(name):
    """attention_impl='splash' (interpret mode here): the model hands it the rule; logits
    on a packed, padded batch match the float64 reference's real rows. A bias scheme is
    refused by the config, naming the alternative."""
    from jaxformer.model.config import ConfigError
    cfg = small(**VARIANTS[name], attention_impl="splash")
    tokens, params = init(cfg, batch=2, seq=12)
    seg = np.array([[1] * 5 + [2] * 4 + [3] * 3, [1] * 7 + [2] * 3 + [0] * 2])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    got = logits_of(cfg, params, tokens, positions=pos, segment_ids=seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], np_forward(cfg, params, tokens, pos, seg)[real],
                               rtol=2e-4, atol=2e-4)
    with pytest.raises(ConfigError, match="'splash' adds no bias.*position='alibi'.*blockwise"):
        small(position="alibi", attention_impl="splash")


@pytest.mark.parametrize("name", ["nope-window", "alibi-post-ln", "llama-gqa",
                                  "rope-window-headdim"])
def test_xla_backend_gets_the_mask_as_structure(name, monkeypatch):
    """With positions by index (the default arange) and nothing packed, the model hands
    jax.nn.dot_product_attention is_causal and local_window_size = (window - 1, 0), no
    mask array (cuDNN's fast path); logits match the float64 reference. A packed batch,
    and explicit positions with gaps, get the rule's mask array, and match too."""
    calls = []
    fused = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or fused(*a, **kw))
    cfg = small(**VARIANTS[name], attention_impl="xla")
    t = int(rng.integers(8, 15))
    tokens, params = init(cfg, batch=2, seq=t)
    calls.clear()
    got = logits_of(cfg, params, tokens)
    np.testing.assert_allclose(got, np_forward(cfg, params, tokens), rtol=2e-4, atol=2e-4)
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
    assert len(calls) == cfg.n_layers and all(
        kw["mask"] is None and kw["is_causal"] and kw["local_window_size"] == window
        for kw in calls), calls
    calls.clear()
    seg = np.stack([np.where(np.arange(t) < t // 2, 1, 2), np.where(np.arange(t) < t - 2, 1, 0)])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    got = logits_of(cfg, params, tokens, positions=pos, segment_ids=seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], np_forward(cfg, params, tokens, pos, seg)[real],
                               rtol=2e-4, atol=2e-4)
    assert calls and all(kw["mask"] is not None and "is_causal" not in kw for kw in calls)
    calls.clear()  # explicit positions with gaps and an offset: a window by index is not
    # a window by position, so the fast path must not be taken
    pos = rng.integers(0, 100) + np.cumsum(rng.integers(1, 4, (2, t)), axis=1)
    got = logits_of(cfg, params, tokens, positions=pos)
    np.testing.assert_allclose(got, np_forward(cfg, params, tokens, pos), rtol=2e-4, atol=2e-4)
    assert calls and all(kw["mask"] is not None and "is_causal" not in kw for kw in calls)


def _square_buffers(cfg, t):
    """Shapes in the compiled forward+backward (HLO text) with two dims >= t."""
    tokens = jnp.zeros((1, t), jnp.int32)
    params = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens))["params"]
    loss = lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, tokens))  # noqa: E731
    hlo = jax.jit(jax.grad(loss)).lower(params).compile(DEFAULT_EMITTERS).as_text()
    shapes = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"\[(\d+(?:,\d+)+)\]", hlo)}
    return sorted(s for s in shapes if sum(d >= t for d in s) >= 2)


@pytest.mark.parametrize("position", ["t5", "fire", "sandwich"])
def test_blockwise_train_step_holds_no_t_by_t_buffer(position, monkeypatch):
    """Compiled forward+backward with attention_impl='blockwise': no buffer is [T, S]
    sized: no logits, mask or bias grid (T5's buckets and FIRE's MLP run per block). The
    dense backend's step, the negative control, has them."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", 64)
    monkeypatch.setattr(blockwise, "BLOCK_K", 64)
    settings = {"num_buckets": 8} if position == "t5" else None
    cfg = small(position=position, n_kv_heads=2, position_settings=settings,
                attention_impl="blockwise")
    assert _square_buffers(cfg, 320) == []
    assert _square_buffers(cfg.replace(attention_impl="chunked"), 320) != []


# ---- invariants for every position scheme and block kind ---------------------------

SCHEMES = list(POSITION_SCHEMES)  # the table: a new scheme is tested by being added


@pytest.mark.parametrize("block", ["pre_ln", "post_ln"])
@pytest.mark.parametrize("position", SCHEMES)
def test_causality(position, block):
    """Changing token t changes no logit before t, and does change logits from t on."""
    cfg = small(position=position, block=block, n_kv_heads=2)
    tokens, params = init(cfg, batch=1, seq=16)
    t = int(rng.integers(1, 15))
    changed = tokens.at[0, t].set((tokens[0, t] + 1) % cfg.vocab_size)
    before, after = logits_of(cfg, params, tokens), logits_of(cfg, params, changed)
    np.testing.assert_array_equal(before[0, :t], after[0, :t])
    assert np.abs(before[0, t:] - after[0, t:]).max() > 1e-4


@pytest.mark.parametrize("position", SCHEMES)
def test_padding_changes_nothing(position):
    """Pad tokens (segment id 0) after a sequence change none of its logits; all-pad rows
    are finite."""
    cfg = small(position=position)
    tokens, params = init(cfg, batch=3, seq=12)
    n = int(rng.integers(3, 10))
    seg = np.zeros((3, 12), np.int32)
    seg[:2, :n] = 1  # row 2 is all padding
    other = tokens.at[:, n:].set(jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 12 - n))))
    a = logits_of(cfg, params, tokens, segment_ids=seg)
    b = logits_of(cfg, params, other, segment_ids=seg)
    np.testing.assert_array_equal(a[:2, :n], b[:2, :n])
    alone = logits_of(cfg, params, tokens[:2, :n])
    np.testing.assert_allclose(a[:2, :n], alone, rtol=1e-5, atol=1e-5)
    assert np.isfinite(a).all() and np.isfinite(b).all()


@pytest.mark.parametrize("block", ["pre_ln", "post_ln"])
@pytest.mark.parametrize("position", SCHEMES)
def test_packing_equals_separate(position, block):
    """Two documents packed in one row, with segment ids and restarted positions, give the
    logits each gives alone: at the start of a row of its own, where the causal mask keeps
    it from the tokens that follow it (the rows keep one width, so the compiled ops are
    shared by every case)."""
    cfg = small(position=position, block=block, n_kv_heads=2, sliding_window=6)
    tokens, params = init(cfg, batch=1, seq=14)
    n = int(rng.integers(3, 11))
    seg = jnp.asarray([[1] * n + [2] * (14 - n)])
    packed = logits_of(cfg, params, tokens, positions=segment_positions(seg), segment_ids=seg)
    alone = logits_of(cfg, params, jnp.stack([tokens[0], jnp.roll(tokens[0], -n)]))
    np.testing.assert_allclose(packed[0, :n], alone[0, :n], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(packed[0, n:], alone[1, :14 - n], rtol=1e-5, atol=2e-5)


def test_default_positions_are_arange_and_shift_matters():
    cfg = small(position="learned")
    tokens, params = init(cfg, batch=2, seq=8)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    np.testing.assert_array_equal(logits_of(cfg, params, tokens),
                                  logits_of(cfg, params, tokens, positions=pos))
    shifted = logits_of(cfg, params, tokens, positions=pos + 3)
    assert np.abs(shifted - logits_of(cfg, params, tokens)).max() > 1e-4


# every scheme that sees only offsets (or, CoPE, no positions at all); FIRE normalises by
# the query's position, the absolute ones add the position itself
RELATIVE = [n for n, s in POSITION_SCHEMES.items() if s.kind not in ("absolute", "none")
            and n != "fire"]


@pytest.mark.parametrize("position", RELATIVE)
def test_relative_schemes_are_shift_invariant(position):
    """Relative schemes see only offsets: shifting every position by s changes nothing."""
    cfg = small(position=position)
    tokens, params = init(cfg, batch=2, seq=10)
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    s = int(rng.integers(1, 500))
    np.testing.assert_allclose(logits_of(cfg, params, tokens, positions=pos + s),
                               logits_of(cfg, params, tokens), rtol=1e-4, atol=1e-4)


def test_learned_positions_beyond_table_is_an_error():
    cfg = small(position="learned", max_seq_len=8)
    tokens, params = init(cfg, batch=1, seq=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len=8"):
        logits_of(cfg, params, jnp.zeros((1, 9), jnp.int32))


# ---- scan / remat / precision / dropout --------------------------------------------

@pytest.mark.parametrize("position", ["rope", "alibi", "t5", "fire"])
def test_scan_equals_loop(position):
    cfg = small(position=position, n_layers=3)
    tokens, params = init(cfg)
    scan_cfg = cfg.replace(scan_layers=True)
    stacked = stack_layers(params, cfg.n_layers)
    assert jax.tree.leaves(stacked["blocks"])[0].shape[0] == 3
    scan_shapes = jax.tree.map(lambda x: x.shape, Transformer(scan_cfg).init(
        jax.random.key(0), tokens)["params"])
    assert jax.tree.map(lambda x: x.shape, stacked) == scan_shapes
    np.testing.assert_allclose(logits_of(scan_cfg, stacked, tokens),
                               logits_of(cfg, params, tokens), rtol=1e-5, atol=1e-5)
    back = unstack_layers(stacked)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, params))


def test_stack_and_unstack_keep_the_order_of_more_than_ten_runs():
    """Twelve layers, dense and sparse alternating, scan as twelve runs blocks_0 ..
    blocks_11 (past ten, where names ordered as text put blocks_10 before blocks_2):
    stack_layers gives the scanned model's params (names, structure, shapes, dtypes), each
    run holding its own layer, and unstack_layers(stack_layers(p)) is p, every layer's
    values back in its place."""
    from jaxformer import param_shapes
    cfg = small(n_layers=12, d_model=16, n_heads=2, ffn="swiglu",
                moe=dict(experts=2, top_k=1, d_ff=8, layers=list(range(1, 12, 2))))
    runs = cfg.layer_runs
    assert [tuple(r) for r in runs] == [(f"blocks_{i}", i, i + 1) for i in range(12)]
    params = jax.tree.map(lambda s: np.asarray(rng.standard_normal(s.shape), s.dtype),
                          param_shapes(cfg))  # fresh values: every layer's its own
    stacked = stack_layers(params, cfg.n_layers)
    described = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert described(stacked) == described(param_shapes(cfg.replace(scan_layers=True)))
    for r in runs:
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a[0], b),
                                         stacked[r.name], params[f"block_{r.start}"]))
    back = unstack_layers(stacked)
    assert sorted(back) == sorted(params)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, params))


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_equal_gradients(remat, scan):
    cfg = small(ffn="swiglu")
    tokens, params = init(cfg)
    if scan:
        cfg, params = cfg.replace(scan_layers=True), stack_layers(params, cfg.n_layers)

    def loss(p, c):
        logits = Transformer(c).apply({"params": p}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_plain, g_remat = grad(params, cfg), grad(params, cfg.replace(remat=remat))
    # the same math, fused differently: float32 rounding apart, relative to each leaf's scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max())), g_remat, g_plain)


# Flags that meet: every value of each factor meets every value of every other in at
# least one row (a pairwise covering; the full product is 504 models).
FACTORS = {"position": SCHEMES, "remat": ["none", "full", "dots"], "scan_layers": [False, True],
           "attention_impl": [n for n in backends_here() if n != "reference"  # every one here
                              and BACKENDS[n].takes_bias], "packed": [False, True],
           "sliding_window": [None, 5]}


def pairwise_rows(factors, seeds=()):
    """Rows {factor: value} in which every pair of values of two factors meets: the
    seeds (partial rows), then the two largest factors' product where the seeds did not
    meet it, each other factor set to the value that meets the most pairs not yet met,
    then rows for any pair still missing."""
    names = list(factors)

    def pairs(row):  # the pairs of values a (partial) row meets
        named = [n for n in names if n in row]
        return {((a, row[a]), (b, row[b])) for i, a in enumerate(named) for b in named[i + 1:]}

    missing = set().union(*(pairs({a: x, b: y}) for i, a in enumerate(names)
                            for b in names[i + 1:] for x in factors[a] for y in factors[b]))

    def complete(row):
        for name in names:
            if name not in row:
                row[name] = max(factors[name], key=lambda v: len(missing & pairs({**row, name: v})))
        missing.difference_update(pairs(row))
        return {n: row[n] for n in names}

    first, second = sorted(names, key=lambda n: -len(factors[n]))[:2]
    rows = [complete(dict(seed)) for seed in seeds]
    rows += [complete({first: x, second: y}) for x in factors[first] for y in factors[second]
             if not any(row[first] == x and row[second] == y for row in rows)]
    while missing:
        (a, x), (b, y) = min(missing, key=repr)
        rows.append(complete({a: x, b: y}))
    return rows


# seeded with the long-context setting of each bias scheme: blockwise, remat, scanned
COMBINATIONS = pairwise_rows(FACTORS, seeds=[
    dict(position=p, remat="full", scan_layers=True, attention_impl="blockwise")
    for p in ("alibi", "t5", "fire")])


def test_the_combinations_meet_every_pair():
    names = list(FACTORS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            met = {(row[a], row[b]) for row in COMBINATIONS}
            assert met == {(x, y) for x in FACTORS[a] for y in FACTORS[b]}, (a, b)
    for p in ("alibi", "t5", "fire"):
        assert dict(position=p, remat="full", scan_layers=True, attention_impl="blockwise") \
            .items() <= next(row for row in COMBINATIONS if row["position"] == p
                             and row["remat"] == "full").items()
    assert len(COMBINATIONS) <= 2 * len(SCHEMES) * 3  # far fewer than the product


@functools.partial(jax.jit, static_argnums=0)
def _logits_and_grads(cfg, params, tokens, positions, segment_ids, w):
    def loss(p):
        logits = Transformer(cfg).apply({"params": p}, tokens, positions=positions,
                                        segment_ids=segment_ids)
        return jnp.sum(w * logits), logits
    # jitted: eagerly, each scan and remat inside re-traces and compiles op by op
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda row: "-".join(
    f"{v}" if k != "sliding_window" else f"w{v}" for k, v in row.items()))
def test_flags_together_match_the_reference(combo, monkeypatch):
    """Position scheme x remat x scan x backend x packing x window, as they meet in a
    training step: the logits against the float64 forward, and every param's gradient
    against the reference backend's (unscanned, no remat) on the same batch."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", int(rng.integers(3, 6)))  # several blocks
    monkeypatch.setattr(blockwise, "BLOCK_K", int(rng.integers(3, 6)))
    flags = {k: v for k, v in combo.items() if k != "packed"}
    if POSITION_SCHEMES[combo["position"]].kind == "contextual":  # reference alone runs it
        flags["attention_impl"] = "reference"  # (the others refuse: test_attention.py)
    cfg = small(**flags, n_kv_heads=2)
    t = 12
    tokens, params = init(cfg.replace(scan_layers=False), batch=2, seq=t)  # per layer
    pos = seg = None
    if combo["packed"]:
        cut = int(rng.integers(2, t - 2))
        seg = np.stack([np.where(np.arange(t) < cut, 1, 2),
                        np.where(np.arange(t) < cut + 1, 1, 0)]).astype(np.int32)  # padded
        pos = np.asarray(segment_positions(jnp.asarray(seg)))
    real = np.ones((2, t), bool) if seg is None else seg > 0
    w = jnp.asarray(rng.standard_normal((2, t, cfg.vocab_size)) * real[..., None], jnp.float32)
    reference = cfg.replace(attention_impl="reference", remat="none", scan_layers=False)
    want_logits, want = _logits_and_grads(reference, params, tokens, pos, seg, w)
    np.testing.assert_allclose(np.asarray(want_logits)[real],
                               np_forward(cfg, params, tokens, pos, seg)[real],
                               rtol=2e-4, atol=2e-4)
    if cfg.scan_layers:
        params, want = stack_layers(params, cfg.n_layers), stack_layers(want, cfg.n_layers)
    logits, got = _logits_and_grads(cfg, params, tokens, pos, seg, w)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(want_logits)[real],
                               rtol=1e-4, atol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        ref = functools.reduce(lambda x, k: x[k.key], path, want)
        # a scalar param's gradient (FIRE's c and threshold) sums every (query, key) pair's
        # part, cancelling: over 30 draws the reference and ring backends' gradients of c
        # differed by at most 1e-4 relative (5e-4 at |c| = 0.0015, which init no longer draws)
        np.testing.assert_allclose(g, ref, rtol=1e-2 if np.ndim(ref) == 0 else 1e-3,
                                   atol=2e-5, err_msg=str(path))


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_bf16_compute_close_to_float32(name):
    cfg = small(**VARIANTS[name], d_model=64)
    tokens, params = init(cfg, batch=2, seq=16)
    full = logits_of(cfg, params, tokens)
    half = logits_of(cfg.replace(dtype="bfloat16"), params, tokens)
    assert half.dtype == np.float32
    rel = np.linalg.norm(half - full) / np.linalg.norm(full)
    assert rel < 2e-2, rel


def test_dropout_only_when_not_deterministic():
    cfg = small(dropout=0.5)
    tokens, params = init(cfg)
    model = Transformer(cfg)
    clean = model.apply({"params": params}, tokens)
    np.testing.assert_array_equal(clean, logits_of(cfg.replace(dropout=0.0), params, tokens))
    noisy = [model.apply({"params": params}, tokens, deterministic=False,
                         rngs={"dropout": jax.random.key(i)}) for i in (1, 2)]
    assert np.abs(noisy[0] - clean).max() > 1e-3 and np.abs(noisy[0] - noisy[1]).max() > 1e-3


# ---- compiled backward pass: no transposed activations ---------------------------------


LLAMA = dict(position="rope", norm="rmsnorm", ffn="swiglu", use_bias=False,
             tie_embeddings=False, n_kv_heads=2)


def grad_hlo(extra, b=2, t=64, compiled=True):
    """(config, optimized HLO text) of the loss gradient of a 2-layer model; compiled False:
    its StableHLO as lowered, before XLA's passes."""
    from jaxformer.training.step import loss_sums
    cfg = ModelConfig(**{**dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=t,
                                position="learned"), **extra})
    model = Transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, 96, (b, t + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((b, t), np.float32)}
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :8])["params"]
    lowered = jax.jit(jax.grad(lambda p: loss_sums(model, p, batch)[0])).lower(params)
    return cfg, lowered.compile(DEFAULT_EMITTERS).as_text() if compiled else lowered.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering")
@pytest.mark.parametrize("extra", [{}, LLAMA])
def test_backward_has_no_transposed_activation(extra):
    """Every weight matmul is a 2-D dot (jaxformer.core.matmul): XLA:CPU then computes the
    weight gradients X^T dY without materialising any activation transposed to
    [features, tokens] (3-D dots made it copy one per weight, fusing the elementwise work
    that produced X or dY into a strided loop: a third of the bench step's backward)."""
    b, t = 2, 64  # 128 tokens: no feature size below equals it
    cfg, hlo = grad_hlo(extra, b, t)
    features = {cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim,
                cfg.n_kv_heads * cfg.head_dim, cfg.vocab_size}
    assert b * t not in features
    transposed = re.compile(r"= f32\[(%s),%d\]" % ("|".join(map(str, features)), b * t))
    found = [line.strip()[:120] for line in hlo.splitlines() if transposed.search(line)]
    assert not found, f"{len(found)} activations transposed to [features, tokens]: {found[:3]}"


@pytest.mark.parametrize("scan", [False, True])
def test_rope_angles_are_computed_once_per_step(scan):
    """Every layer rotates q and k by the same angles: the compiled train-step gradient
    holds one cosine and one sine, not one per layer and per use (fused into each rotation,
    they were recomputed per element of q and k: ~8% of the Llama bench step)."""
    _, hlo = grad_hlo({**LLAMA, "scan_layers": scan})
    counts = {op: hlo.count(f" {op}(") for op in ("cosine", "sine")}
    assert counts == {"cosine": 1, "sine": 1}, counts


# ---- today's architectures: layer patterns, QK-norm, soft-caps under every backend -------

GEMMA3_LIKE = dict(position="rope", norm="rmsnorm_offset", block="sandwich", qk_norm="head",
                   ffn="geglu", n_kv_heads=2, n_layers=3, head_dim=12, rope_fraction=0.5,
                   attn_softcap=1.5, final_softcap=4.0, embed_multiplier=32 ** 0.5,
                   layer_pattern=("local", "global"),
                   layer_kinds={"local": {"window": 3, "rope_theta": 100.0},
                                "global": {"rope_theta": 1e4}})


@pytest.mark.parametrize("impl, block, qk_norm", [("chunked", "sandwich", "head"),
                                                  ("blockwise", "res_post_ln", "projection"),
                                                  ("blockwise", "parallel", "head")])
def test_layer_patterns_scanned_and_rematted_match_the_reference(impl, block, qk_norm,
                                                                  monkeypatch):
    """A Gemma 3-like model (a local/global pattern with two RoPE bases, QK-norm, partial
    rotary, both soft-caps) on a packed and padded batch: scanned with remat under
    chunked or blockwise, its logits and every param's gradient equal the unscanned
    reference backend's (which tests/hf/test_families.py holds to transformers')."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", int(rng.integers(2, 5)))
    monkeypatch.setattr(blockwise, "BLOCK_K", int(rng.integers(2, 5)))
    cfg = small(**{**GEMMA3_LIKE, "block": block, "qk_norm": qk_norm},
                attention_impl=impl, scan_layers=True, remat="full")
    t = 12
    tokens, params = init(cfg.replace(scan_layers=False), batch=2, seq=t)
    params = jax.tree.map(lambda x: 3 * x, params)  # logits wide enough for the caps to bind
    cut = int(rng.integers(3, t - 3))
    seg = np.stack([np.where(np.arange(t) < cut, 1, 2),
                    np.where(np.arange(t) < t - 2, 1, 0)]).astype(np.int32)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    real = seg > 0
    w = jnp.asarray(rng.standard_normal((2, t, cfg.vocab_size)) * real[..., None], jnp.float32)
    reference = cfg.replace(attention_impl="reference", remat="none", scan_layers=False)
    want_logits, want = _logits_and_grads(reference, params, tokens, pos, seg, w)
    uncapped = cfg.replace(attention_impl="reference", remat="none", scan_layers=False,
                           attn_softcap=None)
    assert np.abs(np.asarray(_logits_and_grads(uncapped, params, tokens, pos, seg, w)[0])
                  - np.asarray(want_logits))[real].max() > 1e-2  # the cap binds
    logits, got = _logits_and_grads(cfg, stack_layers(params, cfg.n_layers), tokens, pos,
                                    seg, w)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(want_logits)[real],
                               rtol=1e-4, atol=1e-5)
    want = stack_layers(want, cfg.n_layers)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        ref = functools.reduce(lambda x, k: x[k.key], path, want)
        # params x3 give gradients up to ~10: float32 rounding of a near-cancelling entry
        # reached 5.7e-5 (1 entry of 12,288, once, under a loaded full run)
        np.testing.assert_allclose(g, ref, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(ref).max()),
                                   err_msg=str(path))
