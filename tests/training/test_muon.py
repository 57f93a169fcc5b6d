"""optim.name=muon: Newton-Schulz-orthogonalised momentum on the blocks' matrices against a
float64 NumPy reference (every kind of matrix: a 3-D attention kernel, the attention output
with two input axes, a stacked layer axis, an expert stack, MLA's up-projections), AdamW on
the rest against its own float64 formula; a tiny run that learns and resumes bitwise. On a
mesh: tests/core/test_sharding.py (test_muon_on_a_mesh_updates_like_one_device)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import ModelConfig, param_shapes
from jaxformer.training.optim import OptimConfig, make_optimizer, muon_dimensions
from tests.training.test_loop import (config, corpus, losses,  # noqa: F401
                                      resumed_like_straight, same_saved_state)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
NS = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic coefficients, 5 steps
LR, WD, BETA, RMS = 0.02, 0.1, 0.95, 0.2
MODELS = {  # every kind of matrix Muon sees
    "moe": dict(ffn="swiglu", norm="rmsnorm", moe=dict(experts=4, top_k=2, d_ff=8, layers=[1]),
                tie_embeddings=False),
    "mla scanned": dict(scan_layers=True, mla=dict(q_lora_rank=8, kv_lora_rank=8,
                                                   qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                   v_head_dim=6)),
}


def np_orthogonalise(m, lead, contracted):
    """m [lead..., in..., out...] -> each lead slice's (in, out) matrix through 5 quintic
    Newton-Schulz steps after normalising by its Frobenius norm, in float64."""
    shape = m.shape
    fan_in = int(np.prod(shape[lead:lead + contracted]))
    flat = m.reshape(int(np.prod(shape[:lead])), fan_in, -1)
    out = []
    for x in flat:
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / (np.linalg.norm(x) + 1e-8)
        for _ in range(5):
            a = x @ x.T
            x = NS[0] * x + (NS[1] * a + NS[2] * a @ a) @ x
        out.append(x.T if tall else x)
    rms = RMS * np.sqrt(max(fan_in, flat.shape[2]))
    return rms * np.stack(out).reshape(shape)


def np_steps(w, grads, muon_dims, decayed):
    """The param after len(grads) steps, in float64: Muon (Nesterov momentum with optax's
    bias correction, orthogonalised, scaled to RMS, decayed) or AdamW (decayed: a kernel)."""
    w, mu, nu = np.float64(w), 0.0, 0.0
    for t, g in enumerate(grads, 1):
        g = np.float64(g)
        if muon_dims is None:  # AdamW (b1 0.9, b2 0.95, eps 1e-8, decay on kernels only)
            mu, nu = 0.9 * mu + 0.1 * g, 0.95 * nu + 0.05 * g * g
            u = (mu / (1 - 0.9 ** t)) / (np.sqrt(nu / (1 - 0.95 ** t)) + 1e-8)
        else:
            mu = BETA * mu + (1 - BETA) * g
            nesterov = BETA * mu / (1 - BETA ** (t + 1)) + (1 - BETA) * g / (1 - BETA ** t)
            u = np_orthogonalise(nesterov, *muon_dims)
        w = w - LR * (u + WD * w * (muon_dims is not None or decayed))
    return w


@pytest.mark.parametrize("model", list(MODELS))
def test_muon_update_matches_float64_newton_schulz(model):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                      **MODELS[model])
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), jnp.float32),
                          param_shapes(cfg))
    tx, _ = make_optimizer(OptimConfig(name="muon", lr=LR, schedule="constant", warmup_steps=0,
                                       weight_decay=WD, clip_norm=None), cfg, 10)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                          params) for _ in range(3)]
    state, new = tx.init(params), params
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, new)
        new = optax.apply_updates(new, updates)
    dims = muon_dimensions(params)
    seen = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(new):
        names = [k.key for k in path]
        d = dims
        for n in names:
            d = d[n]
        muon_dims = None if d is None else (d.reduction_axis[0], len(d.reduction_axis))
        want = np_steps(np.asarray(leaf_of(params, names)), [leaf_of(g, names) for g in grads],
                        muon_dims, decayed=names[-1] == "kernel")
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=2e-4, atol=2e-5,
                                   err_msg="/".join(names))
        seen.add((names[-2] if names[-1] == "kernel" else names[-1], muon_dims))
    adamw = {n for n, d in seen if d is None}
    assert {"embedding", "scale"} <= adamw, seen  # the token table and the norms: AdamW
    assert ("out", (int(cfg.scan_layers), 2)) in seen  # heads x head_dim -> embed
    if model == "moe":
        assert ("wi_gate", (1, 1)) in seen and ("lm_head", None) in seen
    else:
        assert ("key_up", (1, 1)) in seen and ("q_up", (1, 1)) in seen


def leaf_of(tree, names):
    for n in names:
        tree = tree[n]
    return np.asarray(tree)


def test_muon_trains_and_resumes_bitwise(corpus, tmp_path):  # noqa: F811
    """configs/tiny.yaml with optim.name=muon: the loss falls; resumed from the checkpoint
    of step 3 (a copy of the run with the later one removed), the run repeats the
    uninterrupted one's losses, params and optimizer state bit for bit."""
    same = ("optim.name=muon", "train.steps=6", "checkpoint.every=3", "train.eval_every=100",
            "train.sample_tokens=0")
    cfg, _, straight, resumed = resumed_like_straight(lambda d: config(corpus, d, *same),
                                                      tmp_path)
    run = losses(straight)
    assert run[6] < run[1]
    same_saved_state(cfg, straight, resumed)  # Muon's momentum too


def test_unknown_optimizer_is_one_line():
    from jaxformer.core.validation import ConfigError
    with pytest.raises(ConfigError) as err:
        OptimConfig(name="sgd")
    assert "optim.name='sgd'" in str(err.value) and "muon" in str(err.value)
    assert "\n" not in str(err.value)


SEQ2SEQ = {  # T5 v1.1's shape (untied head, one input table) and BART's (biases, post-LN)
    "t5": dict(position="t5", norm="rmsnorm", ffn="geglu", use_bias=False, qkv_bias=False,
               tie_embeddings=False, tie_source_embed=True),
    "bart": dict(position="learned", norm="layernorm", block="post_ln", use_bias=True,
                 qkv_bias=True, embed_norm=True, head_bias=True),
    "t5 scanned": dict(position="t5", norm="rmsnorm", ffn="geglu", use_bias=False,
                       qkv_bias=False, tie_embeddings=False, tie_source_embed=True,
                       scan_layers=True),
}


def muon_rule(names):
    """Muon's matrices written from a param's path alone: a kernel of a layer (block_i, or a
    stacked run) at the top or under encoder/ or decoder/ -> (lead axes, contracted axes):
    the layer axis when stacked, the attention output's two input axes; else None."""
    layer = names[1] if names[0] in ("encoder", "decoder") else names[0]
    stacked = layer == "blocks"
    if not (stacked or layer.startswith("block_")) or names[-1] != "kernel":
        return None
    return int(stacked), 2 if names[-2] == "out" else 1


@pytest.mark.parametrize("model", list(SEQ2SEQ))
def test_muon_updates_every_encoder_decoder_block_matrix(model):
    """model.arch=encoder_decoder: one Muon step on random params and gradients equals the
    float64 Newton-Schulz step on exactly the matrices of the encoder's and the decoder's
    blocks (self- and cross-attention, FFN, by muon_rule from the paths; per layer where
    scanned) and float64 AdamW on the rest (embeddings, head, norms, biases, position
    params)."""
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=32, d_model=16, d_ff=24, n_heads=2,
                      n_layers=2, encoder_layers=1, max_seq_len=16, **SEQ2SEQ[model])
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), jnp.float32),
                          param_shapes(cfg))
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                         params)
    tx, _ = make_optimizer(OptimConfig(name="muon", lr=LR, schedule="constant", warmup_steps=0,
                                       weight_decay=WD, clip_norm=None), cfg, 10)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    matrices = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(new):
        names = [k.key for k in path]
        dims = muon_rule(names)
        want = np_steps(leaf_of(params, names), [leaf_of(grads, names)], dims,
                        decayed=names[-1] == "kernel")
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=2e-4, atol=2e-5,
                                   err_msg="/".join(names))
        if dims is not None:
            matrices.add((names[0], names[-3], names[-2], dims))
    lead = int(cfg.scan_layers)  # the rule found every kind of matrix
    for stack in ("encoder", "decoder"):
        assert {(stack, "attn", "query", (lead, 1)), (stack, "attn", "out", (lead, 2)),
                (stack, "ffn", "wo", (lead, 1))} <= matrices, matrices
    assert {("decoder", "cross_attn", "key", (lead, 1)),
            ("decoder", "cross_attn", "out", (lead, 2))} <= matrices, matrices
