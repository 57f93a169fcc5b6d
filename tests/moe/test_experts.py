"""The mixture of experts' math (jaxformer.moe.experts) against float64 NumPy definitions: each
router, each dispatch (ragged and capacity against the dense reference and a loop), the
balancing losses; and a model with sparse layers: gradients, scanning, its config."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import (ModelConfig, Transformer, flops_per_token, param_shapes, stack_layers,
                       unstack_layers)
from jaxformer.core.validation import ConfigError
from jaxformer.model.kinds import FFNS
from jaxformer.moe.experts import (DISPATCHES, GROUPED, ROUTERS, MoEConfig, balance_losses,
                                   balanced_bias, capacity_dispatch, expert_load, route, take_rows)
from jaxformer.moe.grouped_matmul import GROUPED_MATMULS, tile_sizes
from tests.conftest import DEFAULT_EMITTERS

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


# ---- routing: the definitions in float64 -------------------------------------------------


def np_route(logits, m: MoEConfig, bias=None):
    """weights [N, k] and experts [N, k] (as chosen, best first) by the definitions."""
    logits = logits.astype(np.float64)
    if m.router == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    choice = scores + (0 if bias is None else bias)
    n, n_exp = scores.shape
    weights, experts = np.zeros((n, m.top_k)), np.zeros((n, m.top_k), int)
    for i in range(n):
        allowed = np.ones(n_exp, bool)
        if m.groups > 1:
            g = choice[i].reshape(m.groups, -1)
            score = (np.sort(g, -1)[:, -2:].sum(-1) if m.router == "sigmoid" else g.max(-1))
            keep = np.argsort(-score)[:m.topk_groups]
            allowed = np.isin(np.arange(n_exp) // (n_exp // m.groups), keep)
        order = [j for j in np.argsort(-choice[i]) if allowed[j]][:m.top_k]
        experts[i], weights[i] = order, scores[i, order]
    if m.norm_topk or m.router == "topk_softmax":
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * m.routed_scale, experts


ROUTES = {
    "softmax_topk": dict(router="softmax_topk"),
    "softmax_topk-norm-scaled": dict(router="softmax_topk", norm_topk=True, routed_scale=2.5),
    "topk_softmax": dict(router="topk_softmax", top_k=3),
    "softmax-groups": dict(router="softmax_topk", groups=4, topk_groups=2, top_k=3),
    "sigmoid-deepseek-v3": dict(router="sigmoid", groups=4, topk_groups=2, top_k=4,
                                norm_topk=True, routed_scale=2.5),
}


@pytest.mark.parametrize("name", ROUTES)
def test_route_matches_the_definition(name):
    m = MoEConfig(**{"experts": 16, "top_k": 2, **ROUTES[name]})
    logits = rng.normal(0, 2, (40, 16)).astype(np.float32)
    bias = rng.normal(0, 0.3, 16).astype(np.float32) if m.has_score_bias else None
    weights, experts, _ = route(jnp.asarray(logits), m, None if bias is None else jnp.asarray(bias))
    want_w, want_e = np_route(logits, m, bias)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("router", ["sigmoid", "softmax_topk"])
def test_groups_exclude_experts_when_every_allowed_choice_is_negative(router):
    """A selection bias below -1 makes every expert's choice score (a score in (0, 1) plus
    the bias) negative: an expert outside a token's topk_groups best groups is still never
    chosen (it is excluded at -inf; at 0 it would beat every allowed score), and the
    experts and weights (from the unbiased scores) are the float64 definition's: groups
    ranked by the sum of their best two biased scores (DeepSeek-V3), or by their best one
    (the softmax router, its bias the balancing one)."""
    m = MoEConfig(experts=16, top_k=4, router=router, groups=4, topk_groups=2, norm_topk=True,
                  routed_scale=2.5, bias_update_rate=0.0 if router == "sigmoid" else 0.01)
    assert m.has_score_bias
    n = 40
    logits = rng.normal(0, 2, (n, 16)).astype(np.float32)
    bias = rng.uniform(-2.0, -1.05, 16).astype(np.float32)  # every choice score below 0
    weights, experts, _ = route(jnp.asarray(logits), m, jnp.asarray(bias))
    want_w, want_e = np_route(logits, m, bias)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=1e-7)
    choice = np_route_scores(logits, router) + bias  # [N, E], all negative
    assert choice.max() < 0
    grouped = np.sort(choice.reshape(n, 4, 4), -1)  # [N, G, E / G], ascending
    group_score = grouped[..., -2:].sum(-1) if router == "sigmoid" else grouped[..., -1]
    best = np.argsort(-group_score, -1)[:, :2]  # [N, topk_groups]
    in_best = (np.asarray(experts)[:, :, None] // 4 == best[:, None, :]).any(-1)  # [N, k]
    assert in_best.all(), np.argwhere(~in_best)


def np_route_scores(logits, router: str):
    """The router's per-expert scores in float64: sigmoid, or softmax over the experts."""
    logits = logits.astype(np.float64)
    if router == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_the_score_bias_moves_the_choice_not_the_weights():
    m = MoEConfig(experts=8, top_k=2, router="sigmoid")
    logits = jnp.asarray(rng.normal(0, 1, (16, 8)).astype(np.float32))
    bias = jnp.zeros(8).at[5].set(10.0)  # expert 5 chosen by every token
    weights, experts, scores = route(logits, m, bias)
    assert bool(jnp.all(jnp.any(experts == 5, axis=1)))
    np.testing.assert_array_equal(np.asarray(weights),
                                  np.take_along_axis(np.asarray(scores), np.asarray(experts), 1))


def test_softmax_bias_router_matches_the_definition():
    """ERNIE 4.5's router (softmax_bias): experts chosen by softmax + selection bias, their
    softmax weights divided by max(their sum, 1e-12), in float64. In the last 8 tokens one
    expert holds all the probability but its bias bars it: the chosen ones' sum is below
    1e-12, where the clamp, not the sum, divides."""
    m = MoEConfig(experts=8, top_k=3, router="softmax_bias", routed_scale=1.5)
    logits = rng.normal(0, 2, (24, 8))
    bias = rng.normal(0, 0.3, 8)
    bias[0] = -3.0
    logits[16:, 0] = 40.0  # the others' probabilities ~1e-18
    weights, experts, _ = route(jnp.asarray(logits, jnp.float32), m,
                                jnp.asarray(bias, jnp.float32))
    scores = np_route_scores(logits, "softmax")
    want_e = np.argsort(-(scores + bias), -1)[:, :3]
    chosen = np.take_along_axis(scores, want_e, -1)
    total = chosen.sum(-1, keepdims=True)
    assert (total[16:] < 1e-12).all() and (total[:16] > 1e-6).all()
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), 1.5 * chosen / np.maximum(total, 1e-12),
                               rtol=1e-5, atol=0)


# ---- dispatch: ragged and capacity against the reference ------------------------------


def expert_weights(n_experts, d, f, gated, bias):
    names = (("wi_gate", "wi_up") if gated else ("wi",)) + ("wo",)
    w = {}
    for name in names:
        shape = (n_experts, f, d) if name == "wo" else (n_experts, d, f)
        w[name] = rng.normal(0, 0.3, shape).astype(np.float32)
        if bias:
            w[name + "_bias"] = rng.normal(0, 0.3, (n_experts, shape[2])).astype(np.float32)
    return w


def np_expert(x, w, e, ffn):
    """One expert's FFN on x [M, D], float64."""
    def project(h, name):
        bias = w[name + "_bias"][e] if name + "_bias" in w else 0.0
        return h @ w[name][e].astype(np.float64) + bias

    act = lambda h: np.asarray(FFNS[ffn].activation(jnp.asarray(h)), np.float64)  # noqa: E731
    if ffn == "clamped_swiglu":  # gpt-oss's, written out
        g, u = np.minimum(project(x, "wi_gate"), 7.0), np.clip(project(x, "wi_up"), -7.0, 7.0)
        h = (u + 1) * g / (1 + np.exp(-1.702 * g))
    elif FFNS[ffn].gated:
        h = act(project(x, "wi_gate")) * project(x, "wi_up")
    else:
        h = act(project(x, "wi"))
    return project(h, "wo")


def np_moe(x, weights, experts, w, ffn, kept=None):
    """sum_j weights_j expert_j(x) per token, assignments with kept False left out."""
    y = np.zeros(x.shape, np.float64)
    for i in range(x.shape[0]):
        for j, e in enumerate(experts[i]):
            if kept is None or kept[i, j]:
                y[i] += weights[i, j] * np_expert(x[i:i + 1].astype(np.float64), w, e, ffn)[0]
    return y


def routing(n, n_experts, k, idle=()):
    """Random distinct choices per token avoiding the `idle` experts, and weights."""
    pool = [e for e in range(n_experts) if e not in idle]
    experts = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)])
    return rng.uniform(0.1, 1, (n, k)).astype(np.float32), experts.astype(np.int32)


@pytest.mark.parametrize("ffn,bias", [("swiglu", False), ("gelu", True), ("clamped_swiglu", True)])
@pytest.mark.parametrize("dispatch", ["ragged", "dense"])
def test_dispatch_equals_the_definition_with_idle_experts(dispatch, ffn, bias):
    n, d, f, n_experts, k = 24, 16, 8, 6, 2
    x = rng.normal(0, 4 if ffn == "clamped_swiglu" else 1, (n, d)).astype(np.float32)  # clamps
    weights, experts = routing(n, n_experts, k, idle=(0, 4))  # experts 0 and 4 get no token
    w = expert_weights(n_experts, d, f, FFNS[ffn].gated, bias)
    y, dropped = DISPATCHES[dispatch](jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                                      jax.tree.map(jnp.asarray, w), FFNS[ffn])
    np.testing.assert_allclose(np.asarray(y), np_moe(x, weights, experts, w, ffn),
                               rtol=1e-5, atol=1e-5)
    assert float(dropped) == 0


def test_ragged_gradients_equal_the_dense_reference():
    n, d, f, n_experts, k = 20, 16, 8, 6, 3
    x = jnp.asarray(rng.normal(0, 1, (n, d)).astype(np.float32))
    weights, experts = routing(n, n_experts, k, idle=(2,))
    w = jax.tree.map(jnp.asarray, expert_weights(n_experts, d, f, True, True))
    probe = jnp.asarray(rng.normal(0, 1, (n, d)).astype(np.float32))

    def loss(dispatch):
        return lambda x, weights, w: jnp.sum(probe * DISPATCHES[dispatch](
            x, weights, jnp.asarray(experts), w, FFNS["swiglu"])[0])

    got = jax.grad(loss("ragged"), argnums=(0, 1, 2))(x, jnp.asarray(weights), w)
    want = jax.grad(loss("dense"), argnums=(0, 1, 2))(x, jnp.asarray(weights), w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got[2]["wi_gate"][2]).max()) == 0  # the idle expert learns nothing


def np_kept(experts, n_experts, capacity):
    """The capacity rule by its words: first choices before second ones, in token order
    within a choice; an expert takes assignments until it has `capacity`."""
    n, k = experts.shape
    taken, kept = np.zeros(n_experts, int), np.zeros((n, k), bool)
    for j in range(k):
        for i in range(n):
            e = experts[i, j]
            kept[i, j] = taken[e] < capacity
            taken[e] += kept[i, j]
    return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_exactly_the_overflow(factor):
    n, d, f, n_experts, k = 32, 8, 8, 4, 2
    x = rng.normal(0, 1, (n, d)).astype(np.float32)
    weights, experts = routing(n, n_experts, k)
    popular = 3 * n // 4  # first choices on expert 1: more than its slots at every factor
    experts[:popular, 0] = 1  # a popular expert, so its first choices overflow too
    experts[:popular, 1] = np.where(experts[:popular, 1] == 1, 2, experts[:popular, 1])
    w = expert_weights(n_experts, d, f, True, False)
    y, dropped = capacity_dispatch(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                                   jax.tree.map(jnp.asarray, w), FFNS["swiglu"],
                                   capacity_factor=factor)
    kept = np_kept(experts, n_experts, math.ceil(factor * n * k / n_experts))
    assert not kept.all()
    np.testing.assert_allclose(np.asarray(y), np_moe(x, weights, experts, w, "swiglu", kept),
                               rtol=1e-5, atol=1e-5)
    assert float(dropped) == pytest.approx(1 - kept.mean())


def test_capacity_rounds_a_fractional_share_up():
    """factor x N x k / E not whole: each expert holds its ceiling in slots (not the
    floor), so exactly the assignments past ceil(...) are dropped. Every token's first
    choice is expert 1, which overflows; the kept ones are the rule's (np_kept)."""
    k, n_experts, d, f = 2, 4, 8, 8
    while True:  # a fresh size and factor whose share is at least 0.1 from a whole number
        n, factor = int(rng.integers(20, 41)), float(rng.uniform(0.6, 1.4))
        share = factor * n * k / n_experts
        if 0.1 < share - math.floor(share) < 0.9:
            break
    x = rng.normal(0, 1, (n, d)).astype(np.float32)
    weights = rng.uniform(0.1, 1, (n, k)).astype(np.float32)
    experts = np.stack([np.ones(n), rng.choice([0, 2, 3], n)], 1).astype(np.int32)
    w = expert_weights(n_experts, d, f, True, False)
    y, dropped = capacity_dispatch(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                                   jax.tree.map(jnp.asarray, w), FFNS["swiglu"],
                                   capacity_factor=factor)
    kept = np_kept(experts, n_experts, math.ceil(share))
    assert kept[:, 0].sum() == math.ceil(share) < n  # the overflow: ceil's slots exactly
    np.testing.assert_allclose(np.asarray(y), np_moe(x, weights, experts, w, "swiglu", kept),
                               rtol=1e-5, atol=1e-5)
    assert float(dropped) == pytest.approx(1 - kept.mean())


# ---- balancing ----------------------------------------------------------------------------


def test_balance_losses_match_their_formulas():
    n, n_experts, k = 50, 8, 2
    logits = rng.normal(0, 1.5, (n, n_experts)).astype(np.float32)
    m = MoEConfig(experts=n_experts, top_k=k)
    _, experts, scores = route(jnp.asarray(logits), m)
    load = expert_load(experts, n_experts)
    aux, z = balance_losses(jnp.asarray(logits), scores, load)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=n_experts)
    np.testing.assert_array_equal(np.asarray(load), counts)
    assert float(aux) == pytest.approx(n_experts * np.sum(counts / (n * k) * p.mean(0)), rel=1e-5)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    assert float(z) == pytest.approx(np.mean(lse ** 2), rel=1e-5)
    uniform = balance_losses(jnp.zeros((n_experts, n_experts)),
                             jnp.full((n_experts, n_experts), 1 / n_experts),
                             jnp.full(n_experts, 2.0))[0]
    assert float(uniform) == pytest.approx(1.0)  # 1 at perfect balance


def test_balance_losses_under_the_sigmoid_router_normalise_each_tokens_scores():
    """The sigmoid router's scores do not sum to 1 over the experts: the switch loss's p_e
    is the mean over tokens of each token's scores divided by their sum (float64), with
    DeepSeek-V3's groups and selection bias choosing the experts counted in f_e; and a
    masked token (valid 0) counts in neither."""
    n, n_experts, k = 48, 8, 2
    m = MoEConfig(experts=n_experts, top_k=k, router="sigmoid", groups=2, topk_groups=1)
    logits = rng.normal(0.5, 1.5, (n, n_experts)).astype(np.float32)
    bias = rng.normal(0, 0.3, n_experts).astype(np.float32)
    valid = (rng.random(n) < 0.75).astype(np.float32)
    _, experts, scores = route(jnp.asarray(logits), m, jnp.asarray(bias))
    load = expert_load(experts, n_experts, jnp.asarray(valid))
    aux, z = balance_losses(jnp.asarray(logits), scores, load, jnp.asarray(valid))
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert np.abs(sig.sum(-1) - 1).min() > 0.5  # far from a distribution
    p = (sig / sig.sum(-1, keepdims=True))[valid > 0].mean(0)  # [E]
    counts = np.bincount(np.asarray(experts)[valid > 0].ravel(), minlength=n_experts)
    np.testing.assert_array_equal(np.asarray(load), counts)
    want = n_experts * np.sum(counts / counts.sum() * p)
    assert float(aux) == pytest.approx(want, rel=1e-5)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    assert float(z) == pytest.approx(np.mean(lse[valid > 0] ** 2), rel=1e-5)


def test_balanced_bias_moves_toward_the_mean_load():
    load = jnp.asarray([10.0, 2.0, 6.0, 6.0])
    np.testing.assert_allclose(np.asarray(balanced_bias(jnp.zeros(4), load, 0.01)),
                               [-0.01, 0.01, 0, 0])


# ---- a model with sparse layers ---------------------------------------------------------


def moe_cfg(**kw):
    moe = dict(experts=4, top_k=2, d_ff=16, shared_experts=1, shared_gate=True)
    moe.update(kw.pop("moe", {}))
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                 norm="rmsnorm", ffn="swiglu", use_bias=False, max_seq_len=64),
                          **kw, "moe": moe})


def wide_params(cfg, tokens):
    """The model's init (jitted: eager, it runs op by op) plus N(0, 0.1) on every param."""
    init = jax.jit(Transformer(cfg).init)
    params = init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    return jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)


def test_model_gradients_ragged_equal_dense():
    """The whole model's gradients, router and selection bias included (the routers' own
    math: test_route_matches_the_definition)."""
    cfg = moe_cfg(moe=dict(router="sigmoid", norm_topk=True, groups=2, topk_groups=1))
    tokens = jnp.asarray(rng.integers(0, 64, (2, 24)))
    params = wide_params(cfg, tokens)

    def loss(cfg):
        def f(params):
            logits = Transformer(cfg).apply({"params": params}, tokens)
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return jax.jit(jax.value_and_grad(f))

    (got, g_got), (want, g_want) = loss(cfg)(params), loss(
        cfg.replace(moe=cfg.moe.replace(dispatch="dense")))(params)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(g_got):
        r = g_want
        for key in path:
            r = r[key.key]
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g_got["block_0"]["ffn"]["router"]["kernel"]).max()) > 0


def test_scanned_moe_model_equals_the_loop_and_stacks_its_stats():
    cfg = moe_cfg(moe=dict(aux_loss=0.01))
    tokens = jnp.asarray(rng.integers(0, 64, (2, 16)))
    params = wide_params(cfg, tokens)
    looped, stats = Transformer(cfg).apply({"params": params}, tokens, mutable=["moe"])
    scanned, stacked = Transformer(cfg.replace(scan_layers=True)).apply(
        {"params": stack_layers(params, 2)}, tokens, mutable=["moe"])
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), rtol=1e-5, atol=1e-5)
    per_layer = [stats["moe"][f"block_{i}"]["ffn"]["stats"][0]["load"] for i in range(2)]
    np.testing.assert_array_equal(np.asarray(stacked["moe"]["blocks"]["ffn"]["stats"][0]["load"]),
                                  np.stack(per_layer))
    assert float(per_layer[0].sum()) == 2 * 16 * 2  # every token's top_k assignments


def test_dense_and_sparse_layers_mix():
    cfg = moe_cfg(n_layers=3, moe=dict(layers="1"))
    shapes = param_shapes(cfg)
    assert "router" in shapes["block_1"]["ffn"]
    assert "router" not in shapes["block_0"]["ffn"] and "router" not in shapes["block_2"]["ffn"]


def test_flops_count_the_active_experts():
    """6 x (the weights a token multiplies) + attention: a sparse layer's router, top_k of
    its experts and the shared ones, counted here from the param shapes."""
    cfg = moe_cfg(moe=dict(experts=8, top_k=3))
    shapes = param_shapes(cfg)
    ffn = shapes["block_0"]["ffn"]
    experts = sum(np.prod(ffn[n].shape) for n in ("wi_gate", "wi_up", "wo"))
    others = sum(np.prod(x.shape) for x in jax.tree.leaves(
        {k: v for k, v in shapes["block_0"].items() if k != "ffn"}) if x.ndim > 1)
    shared = sum(np.prod(x.shape) for x in jax.tree.leaves(
        {k: v for k, v in ffn.items() if k in ("shared", "shared_gate", "router")}))
    per_layer = others + shared + experts * 3 / 8
    n_matmul = 2 * per_layer + cfg.vocab_size * cfg.d_model
    attention = 12 * cfg.n_heads * cfg.head_dim * 2 * (32 / 2)
    assert flops_per_token(cfg, 32) == pytest.approx(6 * n_matmul + attention)


@pytest.mark.parametrize("moe,words", [
    (dict(experts=4, top_k=5), "top_k=5 exceeds model.moe.experts=4"),
    (dict(experts=6, groups=4), "experts=6 is not divisible by model.moe.groups=4"),
    (dict(experts=8, groups=2, topk_groups=3), "topk_groups=3 exceeds"),
    (dict(experts=8, layers=[0, 5]), "outside 0..1"),
    (dict(experts=8, router="switch"), "router='switch' is not one of"),
    (dict(experts=8, dispatch="capacity"), "capacity needs a capacity_factor"),
    (dict(experts=8, shared_gate=True), "shared_gate needs shared experts"),
])
def test_bad_moe_configs_are_one_line(moe, words):
    with pytest.raises(ConfigError, match=None) as err:
        moe_cfg(moe={"shared_experts": 0, "shared_gate": False, **moe})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_scan_runs_dense_and_sparse_layers_each_as_a_scan():
    """Layers dense, sparse, dense scan as three runs (blocks_0..2); stack_layers and
    unstack_layers go there and back; the scanned KV cache holds each run's layers and a
    cached step gives the full forward's last logits; the bias update reaches the sparse
    run's layer alone, with that layer's load."""
    from jaxformer.attention import kv_cache
    from jaxformer.moe.balancing import layer_stats, rebalanced
    cfg = moe_cfg(n_layers=3, moe=dict(layers=[1], router="sigmoid", bias_update_rate=0.1),
                  scan_layers=True)
    assert [tuple(r) for r in cfg.layer_runs] == [("blocks_0", 0, 1), ("blocks_1", 1, 2),
                                                  ("blocks_2", 2, 3)]
    tokens = jnp.asarray(rng.integers(0, 64, (2, 10)))
    params = wide_params(cfg.replace(scan_layers=False), tokens)
    stacked = stack_layers(params, 3)
    assert sorted(stacked) == ["blocks_0", "blocks_1", "blocks_2", "embed", "final_norm"]
    assert jax.tree.all(jax.tree.map(np.array_equal, unstack_layers(stacked), params))
    loop = jax.jit(Transformer(cfg.replace(scan_layers=False)).apply)
    want = loop({"params": params}, tokens)
    cache = kv_cache.init_cache(cfg, 2, 16)
    assert [cache["layers"][f"blocks_{i}"]["k"].shape[0] for i in range(3)] == [1, 1, 1]
    apply = jax.jit(Transformer(cfg).apply, static_argnames="mutable")  # (eager: op by op)
    _, cache = apply({"params": stacked}, tokens[:, :-1], cache=cache)
    last, _ = apply({"params": stacked}, tokens[:, -1:], cache=cache)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(want[:, -1]), rtol=1e-5,
                               atol=1e-5)
    _, sown = apply({"params": stacked}, tokens, mutable="moe")
    load = layer_stats(cfg, sown["moe"])["load"]  # [1, E]
    assert load.shape == (1, 4) and float(load.sum()) == 2 * 10 * 2
    moved = rebalanced(cfg, stacked, stacked, load, True)
    bias = moved["blocks_1"]["ffn"]["score_bias"]
    np.testing.assert_array_equal(np.asarray(bias[0]), np.asarray(
        balanced_bias(stacked["blocks_1"]["ffn"]["score_bias"][0], load[0], 0.1)))
    assert float(jnp.abs(bias).max()) > 0


def test_routers_table_is_what_the_config_offers():
    with pytest.raises(ConfigError) as err:
        MoEConfig(experts=4, router="nope")
    assert all(name in str(err.value) for name in ROUTERS)


@pytest.mark.parametrize("impl", list(GROUPED_MATMULS))
@pytest.mark.parametrize("m,groups,transpose", [(3, 8, False), (90, 4, True), (200, 6, False),
                                                (1200, 5, True)])
def test_grouped_matmuls_equal_the_definition(impl, m, groups, transpose):
    """Rows sorted by group times their group's kernel (transpose: the kernel given as
    [G, out, in]), with empty groups (one in the middle, one last), fewer rows than groups
    (decoding), and groups long enough for tiles of every size (tile_sizes); gradients by
    the same loops."""
    sizes = rng.multinomial(m, np.full(groups - 2, 1 / (groups - 2)))
    sizes = np.insert(sizes, [1, groups - 2], 0)  # groups 1 and the last get no row
    assert m < 1000 or min(sizes[sizes > 0]) > sum(tile_sizes(m, groups))
    x = rng.normal(0, 1, (m, 12)).astype(np.float32)
    kernel = rng.normal(0, 1, (groups, 12, 5)).astype(np.float32)
    starts = np.cumsum(sizes) - sizes
    want = np.concatenate([x[s:s + n].astype(np.float64) @ kernel[g]
                           for g, (s, n) in enumerate(zip(starts, sizes))])
    given = np.swapaxes(kernel, 1, 2) if transpose else kernel
    fn = functools.partial(GROUPED_MATMULS[impl], sizes=jnp.asarray(sizes, jnp.int32),
                           transpose=transpose)
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(x), jnp.asarray(given))), want,
                               rtol=1e-5, atol=1e-5)
    probe = rng.normal(0, 1, want.shape).astype(np.float32)
    gx, gk = jax.grad(lambda x, k: jnp.sum(fn(x, k) * probe), argnums=(0, 1))(
        jnp.asarray(x), jnp.asarray(given))
    want_gk = np.stack([x[s:s + n].T.astype(np.float64) @ probe[s:s + n]
                        for s, n in zip(starts, sizes)])
    want_gx = np.concatenate([probe[s:s + n] @ kernel[g].T.astype(np.float64)
                              for g, (s, n) in enumerate(zip(starts, sizes))])
    np.testing.assert_allclose(np.asarray(gk), np.swapaxes(want_gk, 1, 2) if transpose
                               else want_gk, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gx), want_gx, rtol=1e-4, atol=1e-4)


def test_grouped_gradient_reads_the_kernels_as_they_are():
    """The dispatch's grouped matmul (jaxformer.moe.experts.GROUPED) multiplies by each kernel's
    transpose in its gradient without a transposed copy: no [G, out, in] array in the
    compiled HLO."""
    sizes = jnp.asarray([40, 0, 70, 90], jnp.int32)
    x, kernel = jnp.ones((200, 12)), jnp.ones((4, 12, 5))
    fn = jax.jit(jax.grad(lambda x, k: jnp.sum(GROUPED(x, k, sizes) ** 2), argnums=(0, 1)))
    hlo = fn.lower(x, kernel).compile(DEFAULT_EMITTERS).as_text()
    assert "f32[4,12,5]" in hlo and "f32[4,5,12]" not in hlo


def test_take_rows_and_its_gradient_equal_the_definition():
    """take_rows (a gather whose gradient is a gather) is x[index // k], and its gradient
    sums each row's probes over the places it went to (float64 NumPy)."""
    n, k = 7, 3
    x = rng.normal(0, 1, (n, 4)).astype(np.float32)
    order = rng.permutation(n * k)
    probe = rng.normal(0, 1, (n * k, 4)).astype(np.float32)
    fn = lambda x: take_rows(x, jnp.asarray(order), jnp.argsort(order), k)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), x[order // k])
    got = jax.grad(lambda x: jnp.sum(fn(x) * probe))(jnp.asarray(x))
    want = np.zeros((n, 4))
    np.add.at(want, order // k, probe.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_ragged_dispatch_gradient_has_no_scatter():
    """The dropless dispatch's gradient sorts and un-sorts rows by gathers (take_rows) and
    counts each expert's rows from the sorted experts: no scatter in its compiled HLO (a
    scatter-add, autodiff's transpose of a gather, is slow on XLA:CPU)."""
    n, d, f, n_experts, k = 64, 16, 8, 4, 2
    weights, experts = routing(n, n_experts, k)
    w = jax.tree.map(jnp.asarray, expert_weights(n_experts, d, f, True, False))

    def loss(x, weights, w):
        return jnp.sum(DISPATCHES["ragged"](x, weights, jnp.asarray(experts), w,
                                            FFNS["swiglu"])[0] ** 2)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = fn.lower(jnp.ones((n, d)), jnp.asarray(weights), w).compile(DEFAULT_EMITTERS)
    assert " scatter(" not in hlo.as_text()


def test_remat_and_scan_keep_the_gradients_and_stats(remat="full"):
    """Rematerialised and scanned layers, a sparse run after a dense one: the gradients of
    the loop without remat, and the stats still sown (the train loss reads them)."""
    cfg = moe_cfg(n_layers=3, moe=dict(router="sigmoid", aux_loss=0.1, layers=[1, 2]))
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)))
    params = wide_params(cfg, tokens)

    def grads(cfg, params):
        def loss(p):
            logits, stats = Transformer(cfg).apply({"params": p}, tokens, mutable=["moe"])
            aux = sum(jnp.sum(s[0]["aux"]) for s in jax.tree.leaves(
                stats, is_leaf=lambda x: isinstance(x, tuple)))
            return jnp.mean(logits ** 2) + aux
        return jax.jit(jax.grad(loss))(params)

    want = grads(cfg, params)
    got = unstack_layers(grads(cfg.replace(remat=remat, scan_layers=True),
                               stack_layers(params, cfg.n_layers)))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        r = want
        for key in path:
            r = r[key.key]
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
