"""Multi-token prediction's accounting (jaxformer.model.mtp): a module whose block has
experts is balanced as the sparse layers are (its statistics in the penalty and the moe_*
metrics, its score_bias moved by its own load), and flops_per_token counts the modules,
against the kernels of the param tree. Fresh random weights and tokens every run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import ModelConfig, Transformer, flops_per_token, param_shapes
from jaxformer.moe import balancing
from jaxformer.training.objectives.language_model import MultiTokenLM, mtp_terms
from jaxformer.training.step import init_state, make_train_step

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
E, K, D, T = 4, 2, 2, 32  # experts, top_k, mtp_depth, seq_len
# the one layer sparse (the MTP blocks' kind); dense dispatch: the cheapest to compile
SPARSE = dict(experts=E, top_k=K, layers=[0], dispatch="dense")


def config(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=48, d_model=16, n_layers=1, n_heads=2, max_seq_len=T,
                       norm="rmsnorm", ffn="swiglu", d_ff=24, use_bias=False,
                       tie_embeddings=False, mtp_depth=D, moe=moe)


def multiplied(shapes) -> float:
    """The weights a token multiplies, from the param tree: every leaf of 2+ axes but the
    embedding table, an expert stack's (ffn wi_gate / wi_up / wo) at top_k / experts."""
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        names = [p.key for p in path]
        if x.ndim < 2 or names[-1] == "embedding":
            continue
        stack = names[-2] == "ffn" and names[-1] in ("wi_gate", "wi_up", "wo") and x.ndim == 3
        total += np.prod(x.shape) * (K / E if stack else 1)
    return total


@pytest.mark.parametrize("moe", [{}, SPARSE], ids=["dense", "sparse"])
def test_flops_count_the_mtp_modules(moe):
    """6 FLOPs per multiplied weight of the param tree (the modules' eh_proj and blocks
    among them) plus the LM head once more per module, and 12 * n_heads * head_dim per
    causal query-key pair in the L main layers and the D modules' blocks."""
    cfg = config(**moe)
    head = D * cfg.d_model * cfg.vocab_size  # the shared head, multiplied again by each module
    attention = 12 * cfg.n_heads * cfg.head_dim * (T / 2) * (cfg.n_layers + D)
    want = 6 * (multiplied(param_shapes(cfg)) + head) + attention
    assert flops_per_token(cfg, T) == pytest.approx(want, rel=1e-9)


def random_batch(cfg, b=2, t=8):
    tokens = rng.integers(0, cfg.vocab_size, (b, t + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "loss_mask": jnp.ones((b, t), jnp.float32)}


@functools.partial(jax.jit, static_argnums=0)
def penalty_and_stats(model, params, batch):
    """(the gradient of MultiTokenLM's balancing penalty (moe.aux_loss x the mean aux over
    the rows) w.r.t. the params, the statistics of the forward)."""
    def penalty(p):
        stats = mtp_terms(model, p, batch)[2]
        return balancing.penalty(model.cfg.moe, stats), stats
    return jax.grad(penalty, has_aux=True)(params)


def test_a_sparse_mtp_block_is_in_the_balancing_statistics():
    """One row of statistics per sparse layer, then per module, each module's load every
    token's top_k assignments; the balancing penalty (moe.aux_loss) reaches every module's
    router."""
    cfg = config(**SPARSE, aux_loss=0.5)
    model = Transformer(cfg)
    # a module whose tokens were routed evenly (f_i = 1 / E) has a flat penalty,
    # E sum_i f_i P_i = 1, and a router gradient of 0: drawn again until none is
    for _ in range(20):
        params = jax.jit(model.init)(jax.random.key(int(rng.integers(1 << 30))),
                                     jnp.zeros((1, 4), jnp.int32))["params"]
        grads, stats = penalty_and_stats(model, params, random_batch(cfg))
        if all(np.ptp(np.asarray(stats["load"])[k]) > 0 for k in range(1, D + 1)):
            break
    else:
        pytest.fail("every draw routed some module's tokens evenly")
    assert stats["load"].shape == (1 + D, E) and stats["aux"].shape == (1 + D,)
    np.testing.assert_array_equal(np.asarray(stats["load"]).sum(-1), 2 * 8 * K)
    for k in range(1, D + 1):
        assert np.abs(grads[f"mtp_{k}"]["block"]["ffn"]["router"]["kernel"]).max() > 1e-6


def test_a_train_step_moves_each_sparse_modules_score_bias_by_its_own_load():
    """With moe.bias_update_rate r (and a learning rate of 0), a step sets each module's
    score_bias to old + r sign(mean load - load), its load counted by that forward's
    routing; moe_load holds a row per sparse layer and per module."""
    cfg = config(**SPARSE, bias_update_rate=0.1)
    model = Transformer(cfg)
    tx = optax.apply_if_finite(optax.sgd(0.0), 10)
    state = init_state(model, tx, int(rng.integers(1 << 30)))
    batch = random_batch(cfg)
    _, sown = jax.jit(lambda p, x: model.apply({"params": p}, x, mutable=["moe"], mtp=True))(
        state.params, batch["inputs"])
    before = jax.device_get(state.params)
    step = make_train_step(model, tx, lambda s: 0.0, objective=MultiTokenLM(1, 0.3))
    state, metrics = step(state, batch)
    assert metrics["moe_load"].shape == (1 + D,)
    for k in range(1, D + 1):
        load = np.asarray(sown["moe"][f"mtp_{k}"]["block"]["ffn"]["stats"][0]["load"])
        old = before[f"mtp_{k}"]["block"]["ffn"]["score_bias"]
        want = old + np.float32(0.1) * np.sign(load.mean() - load).astype(np.float32)
        np.testing.assert_allclose(state.params[f"mtp_{k}"]["block"]["ffn"]["score_bias"],
                                   want, rtol=0, atol=1e-7)
