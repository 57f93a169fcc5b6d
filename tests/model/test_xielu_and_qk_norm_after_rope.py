"""Two rows of jaxformer.model.kinds' tables (Apertus's and Hunyuan's): the xielu FFN (a
gateless MLP, xIELU with learned scalars per layer) and the head_after_rope QK-norm (per
head, on the rotated queries and keys), in a whole Transformer against a float64 NumPy
forward written from their formulas; xIELU's beta and eps take no gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Transformer
from tests.model.test_transformer import init, logits_of, np_dense, np_norm, np_rope, small

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
CFG = dict(position="rope", norm="rmsnorm", ffn="xielu", qk_norm="head_after_rope",
           use_bias=False, n_kv_heads=2, d_ff=48, tie_embeddings=False)


def np_xielu(x, p):
    """xIELU (Huang et al. 2024) of its raw scalars p, in float64."""
    softplus = lambda a: np.log1p(np.exp(a))  # noqa: E731
    a_p, a_n, beta = softplus(p["alpha_p"]), p["beta"] + softplus(p["alpha_n"]), p["beta"]
    return np.where(x > 0, a_p * x * x + beta * x,
                    (np.expm1(np.minimum(x, p["eps"])) - x) * a_n + beta * x)


def np_layer(cfg, p, x, pos):
    """One pre-LN layer: attention with its QK-norm after RoPE, then the xIELU MLP."""
    h = np_norm(cfg, p["attn_norm"], x)
    a = p["attn"]
    q = np_rope(np_dense(a["query"], h, "btd,dnh->btnh"), pos, cfg.rope_theta)
    k = np_rope(np_dense(a["key"], h, "btd,dkh->btkh"), pos, cfg.rope_theta)
    q, k = np_norm(cfg, a["q_norm"], q), np_norm(cfg, a["k_norm"], k)
    v = np_dense(a["value"], h, "btd,dkh->btkh")
    g = cfg.n_heads // cfg.n_kv_heads
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n: kv head n // g
    s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(cfg.head_dim)
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    z = np.einsum("bnts,bsnh->btnh", w / w.sum(-1, keepdims=True), v)
    x = x + np.einsum("btnh,nhd->btd", z, a["out"]["kernel"])
    u = np_dense(p["ffn"]["wi"], np_norm(cfg, p["ffn_norm"], x), "btd,df->btf")
    return x + np_dense(p["ffn"]["wo"], np_xielu(u, p["ffn"]), "btf,fd->btd")


def np_logits(cfg, params, tokens):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    x = p["embed"]["embedding"][np.asarray(tokens)]
    for i in range(cfg.n_layers):
        x = np_layer(cfg, p[f"block_{i}"], x, pos)
    return np_norm(cfg, p["final_norm"], x) @ p["lm_head"]["kernel"]


def drawn(cfg):
    """Tokens and params with each layer's xIELU scalars drawn (eps negative enough that
    min(x, eps) binds) and QK-norm scales far from 1 (so that their place shows)."""
    tokens, params = init(cfg)
    for i in range(cfg.n_layers):
        ffn, attn = params[f"block_{i}"]["ffn"], params[f"block_{i}"]["attn"]
        ffn.update(alpha_p=jnp.float32(rng.normal()), alpha_n=jnp.float32(rng.normal()),
                   beta=jnp.float32(rng.uniform(0.2, 0.8)),
                   eps=jnp.float32(-rng.uniform(0.05, 0.3)))
        for name in ("q_norm", "k_norm"):
            attn[name]["scale"] = attn[name]["scale"] + 0.5 * jnp.asarray(
                rng.standard_normal(attn[name]["scale"].shape), jnp.float32)
    return tokens, params


def test_xielu_and_qk_norm_after_rope_match_the_reference():
    cfg = small(**CFG)
    tokens, params = drawn(cfg)
    want = np_logits(cfg, params, tokens)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), want, rtol=2e-4, atol=2e-4)
    before = logits_of(cfg.replace(qk_norm="head"), params, tokens)  # the other placement
    assert np.abs(before - want).max() > 1e-2


def test_xielu_beta_and_eps_take_no_gradient_and_experts_refuse_it():
    cfg = small(**CFG)
    tokens, params = drawn(cfg)
    grads = jax.grad(lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, tokens) ** 2))(
        params)["block_0"]["ffn"]
    assert grads["beta"] == 0 and grads["eps"] == 0
    assert grads["alpha_p"] != 0 and grads["alpha_n"] != 0
    with pytest.raises(ValueError, match="ffn=xielu"):
        init(small(**CFG, moe=dict(experts=4, top_k=2)))
