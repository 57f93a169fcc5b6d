"""model.matmul_precision (jaxformer.core.low_precision): the quantised recipes (fp8,
fp8_rowwise, int8) against a float64 NumPy fake quantisation of the same recipe (scales,
round to nearest even onto the format's grid, saturation at its max), forward and gradients,
in a projection's dot and in the experts' grouped matmul (fp8_rowwise's each dot scaled
along its own axis); a model's loss and gradients in each of them scanned and
rematerialised equal the unscanned, an MoE model's alike under the dropless and capacity
dispatches, and on 8 devices equal one
(tests/core/low_precision_worker.py); each entry's batch invariance as it says; a short fp8
training run ends near bf16's, and an fp8 run resumes bit for bit."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.low_precision import E4M3, E5M2, MATMUL_PRECISIONS, to_grid
from jaxformer.core.matmul import projection_dot
from jaxformer.decode import generate
from jaxformer.model.config import ConfigError
from jaxformer.model.layer_runs import stack_layers
from jaxformer.moe.grouped_matmul import grouped_matmul
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step
from tests.conftest import REPO, assert_greedy_up_to_near_ties
from tests.training.test_loop import (config, corpus,  # noqa: F401  (corpus: the fixture)
                                      resumed_like_straight, same_saved_state)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
F32 = np.float32


def float_step(mantissa: int, min_exp: int):
    """The spacing of a float format's values at v: 2^(e - mantissa), e v's exponent (at
    least min_exp: the subnormals' spacing below)."""
    return lambda v: 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(v), 1e-300))),
                                        min_exp) - mantissa)


def on_grid(step, top: float):
    """Rounding in float64: saturated at top, then to the nearest multiple of step(v), ties
    to even (np.round)."""
    def grid(v):
        v = np.clip(v, -top, top)
        return np.round(v / step(v)) * step(v)
    return grid


STEPS = {"e4m3": float_step(3, -6), "e5m2": float_step(2, -14), "int8": lambda v: np.ones_like(v)}
GRIDS = {  # name: (jnp dtype, the float64 rounding, the format's max)
    "e4m3": (E4M3, on_grid(STEPS["e4m3"], 448.0), 448.0),
    "e5m2": (E5M2, on_grid(STEPS["e5m2"], 57344.0), 57344.0),
    "int8": (jnp.int8, on_grid(STEPS["int8"], 127.0), 127.0),
}


def np_quantise(x, fmt, axis=None, pow2=False):
    """The recipe's quantiser in NumPy: (q on the grid, float64; scale, float64). The scale
    and x * scale in float32, as the model computes them (one correctly rounded op each);
    with pow2 the scale rounded down to a power of two (2^floor(log2 scale), exactly)."""
    x = np.asarray(x, F32)
    top = F32(GRIDS[fmt][2])
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = top / np.maximum(amax, F32(1e-12))
    if pow2:
        scale = np.exp2(np.floor(np.log2(scale.astype(np.float64)))).astype(F32)
    return GRIDS[fmt][1]((x * scale).astype(np.float64)), scale.astype(np.float64)


def heavy(*shape):
    """Normal draws times a log-normal spread: values over several binades (some in the
    float8 subnormals once scaled)."""
    return rng.normal(size=shape) * np.exp(1.5 * rng.normal(size=shape))


# ---- the grid -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(GRIDS))
def test_to_grid_rounds_to_nearest_even_and_saturates(fmt):
    dtype, grid, top = GRIDS[fmt]
    n = 512
    v = np.sign(rng.normal(size=n)) * np.exp2(rng.uniform(-14, np.log2(top) + 3, n))  # past top
    g = grid(v)[np.abs(grid(v)) < top]
    ties = g + np.sign(g) * STEPS[fmt](g) / 2  # halfway between two values of the grid
    v = np.concatenate([v, ties, [0.0, top, -top, 10 * top]]).astype(F32)
    out = np.asarray(to_grid(jnp.asarray(v), dtype).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(out, grid(v.astype(np.float64)))


# ---- the projection's dot -------------------------------------------------------------------


def np_fp8(a, b, r):
    """y = a b and (da, db) for the cotangent r, by the fp8 recipe in float64."""
    qa, sa = np_quantise(a, "e4m3")
    qb, sb = np_quantise(b, "e4m3")
    qg, sg = np_quantise(r, "e5m2")
    return qa @ qb / (sa * sb), qg @ qb.T / (sg * sb), qa.T @ qg / (sg * sa)


def np_int8(a, b, r):
    """y = a b and (da, db) for the cotangent r, by the int8 recipe in float64 (per row of
    a, per output channel of b; the backward straight through in float)."""
    qa, sa = np_quantise(a, "int8", axis=1)
    qb, sb = np_quantise(b, "int8", axis=0)
    return qa @ qb / (sa * sb), r @ (qb / sb).T, (qa / sa).T @ r


def np_fp8_rowwise(a, b, r):
    """y = a b and (da, db) for the cotangent r, by the fp8 rowwise recipe in float64: each
    dot's operands in e4m3, scaled along that dot's contracted axis (powers of two)."""
    def dot(x, y):  # x [P, Q] times y [Q, R]
        (qx, sx), (qy, sy) = (np_quantise(x, "e4m3", axis=1, pow2=True),
                              np_quantise(y, "e4m3", axis=0, pow2=True))
        return qx @ qy / (sx * sy)
    return dot(a, b), dot(r, b.T), dot(a.T, r)


RECIPES = {"fp8": np_fp8, "fp8_rowwise": np_fp8_rowwise, "int8": np_int8}


def test_every_quantised_precision_has_a_reference():
    """An entry of the table that is not a plain cast (its own dot) is tested here."""
    plain = {"default", "float32", "bf16"}
    assert set(MATMUL_PRECISIONS) - plain == set(RECIPES) == set(GROUPED)


def close(out, ref, rtol=1e-5):
    """Equal up to float32 sums: within rtol of the largest value."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("precision", list(RECIPES))
def test_projection_dot_is_the_recipe_forward_and_backward(precision):
    """A q/k/v-shaped projection: x [B, T, D] times a kernel [D, N, H] (flattened to 2-D
    inside), and the tied head's layout, x times a table [V, D]."""
    dot = projection_dot(precision)
    x, kernel, table = heavy(2, 4, 16), heavy(16, 3, 4), heavy(10, 16)
    for w, dims, w2 in [(kernel, (((2,), (0,)), ((), ())), kernel.reshape(16, 12)),
                        (table, (((2,), (1,)), ((), ())), table.T)]:
        y, vjp = jax.vjp(lambda a, b: dot(a, b, dims), jnp.asarray(x, jnp.float32),
                         jnp.asarray(w, jnp.float32))
        r = rng.normal(size=y.shape)
        dx, dw = vjp(jnp.asarray(r, jnp.float32))
        ref_y, ref_dx, ref_dw = RECIPES[precision](x.reshape(8, 16), w2, r.reshape(8, -1))
        close(y.reshape(8, -1), ref_y)
        close(dx.reshape(8, 16), ref_dx)
        close(np.asarray(dw).reshape(w2.T.shape if w is table else w2.shape),
              ref_dw.T if w is table else ref_dw)


# ---- the experts' grouped matmul --------------------------------------------------------------


def values(x, grid):
    """x on a grid (format, axis[, pow2]; None: as it is) in float64: q / scale."""
    if grid is None:
        return np.asarray(x, np.float64)
    q, scale = np_quantise(x, *grid)
    return q / scale


def np_straight_through(grids):
    """The grouped product's y and (dh, dk) in float64 where h, the kernels and the
    gradient each go on their grid once (`grids`) and both gradient dots reuse them: group
    e's rows times k[e]."""
    def product(h, k, group, r):
        hv, kv, gv = (values(x, grid) for x, grid in zip((h, k, r), grids))
        dk = np.stack([hv[group == e].T @ gv[group == e] for e in range(len(k))])
        return (np.einsum("mi,mio->mo", hv, kv[group]),
                np.einsum("mo,mio->mi", gv, kv[group]), dk)
    return product


def np_rowwise_grouped(h, k, group, r):
    """torchao's float8 rowwise grouped matmul in float64, every operand in e4m3 with
    power-of-two scales along its dot's contracted axis: y of h per row and k per expert
    and output channel; dh of r per row and k per expert and input channel; dk[e] of h and
    r per column over group e's rows."""
    e4m3 = lambda x, axis: values(x, ("e4m3", axis, True))  # noqa: E731
    y = np.einsum("mi,mio->mo", e4m3(h, -1), e4m3(k, -2)[group])
    dh = np.einsum("mo,mio->mi", e4m3(r, -1), e4m3(k, -1)[group])
    dk = np.stack([e4m3(h[group == e], 0).T @ e4m3(r[group == e], 0) if np.any(group == e)
                   else np.zeros(k.shape[1:]) for e in range(len(k))])
    return y, dh, dk


GROUPED = {  # each recipe's grouped product in float64 (grids: format, axis[, pow2])
    "fp8": np_straight_through((("e4m3", None), ("e4m3", None), ("e5m2", None))),
    "fp8_rowwise": np_rowwise_grouped,
    "int8": np_straight_through((("int8", -1), ("int8", -2), None)),
}


@pytest.mark.parametrize("precision", list(RECIPES))
def test_grouped_matmul_is_the_recipe_forward_and_backward(precision):
    """Four experts (one of them empty) over 16 sorted rows, under jit: the grouped
    matmul the dropless dispatch runs (its sizes closed over) and the capacity dispatch's
    [E, C, in] buffers (an einsum, padding rows of zeros)."""
    sizes = np.array([5, 0, 9, 2])
    group = np.repeat(np.arange(4), sizes)
    h, k = heavy(16, 8), heavy(4, 8, 6)
    grouped = MATMUL_PRECISIONS[precision].grouped

    def sorted_rows(a, b):
        return grouped(grouped_matmul, a, b, group, jnp.asarray(sizes))
    y, vjp = jax.vjp(jax.jit(sorted_rows), jnp.asarray(h, jnp.float32),
                     jnp.asarray(k, jnp.float32))
    r = rng.normal(size=y.shape)
    dh, dk = vjp(jnp.asarray(r, jnp.float32))
    for out, ref in zip((y, dh, dk), GROUPED[precision](h, k, group, r)):
        close(out, ref)
    buffers = np.zeros((4, 9, 8))  # each expert's rows, then zeros
    slots = np.concatenate([np.arange(n) for n in sizes])
    buffers[group, slots] = h
    y, vjp = jax.vjp(lambda a, b: grouped(lambda x, w: jnp.einsum("eci,eio->eco", x, w), a, b,
                                          np.repeat(np.arange(4), 9).reshape(4, 9)),
                     jnp.asarray(buffers, jnp.float32), jnp.asarray(k, jnp.float32))
    rb = np.zeros((4, 9, 6))
    rb[group, slots] = r
    dh, dk = vjp(jnp.asarray(rb, jnp.float32))
    ref_y, ref_dh, ref_dk = GROUPED[precision](h, k, group, r)
    close(np.asarray(y)[group, slots], ref_y)
    close(np.asarray(dh)[group, slots], ref_dh)
    close(dk, ref_dk)


def test_rowwise_grouped_scales_each_dot_along_its_own_axis():
    """fp8_rowwise's grouped backward quantises afresh for each dot, as torchao's does: dh's
    kernels per expert and input channel, dk's h and gradient per group and column. An
    entry 2^18 times the rest (in group 0's rows of h, in expert 2's kernel) makes the
    others that share its scale subnormal, so a scale along any other axis moves the
    results; each output is held within float32 rounding of its own terms (the recipe on
    |h|, |k|, |r|: its sum of absolute products), not of the largest output."""
    sizes = np.array([5, 0, 9, 2])
    group = np.repeat(np.arange(4), sizes)
    h, k = heavy(16, 8), heavy(4, 8, 6)
    h[int(rng.integers(0, 5)), int(rng.integers(0, 8))] = 2.0**18
    k[2, int(rng.integers(0, 8)), int(rng.integers(0, 6))] = -(2.0**18)
    grouped = MATMUL_PRECISIONS["fp8_rowwise"].grouped
    y, vjp = jax.vjp(jax.jit(lambda a, b: grouped(grouped_matmul, a, b, group,
                                                   jnp.asarray(sizes))),
        jnp.asarray(h, jnp.float32), jnp.asarray(k, jnp.float32))
    r = rng.normal(size=y.shape)
    outs = (y, *vjp(jnp.asarray(r, jnp.float32)))
    refs = np_rowwise_grouped(h, k, group, r)
    bounds = np_rowwise_grouped(np.abs(h), np.abs(k), group, np.abs(r))
    for name, out, ref, bound in zip(("y", "dh", "dk"), outs, refs, bounds):
        assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= 1e-5 * bound + 1e-30), name


# ---- the model ---------------------------------------------------------------------------------


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                  ffn="swiglu", d_ff=64, norm="rmsnorm", matmul_precision="fp8")


def loss_and_grads(cfg, params, tokens):
    def loss(p):
        logits = Transformer(cfg).apply({"params": p}, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("precision", list(RECIPES))
def test_quantised_model_scanned_and_rematerialised_equals_unscanned(precision):
    cfg = CFG.replace(matmul_precision=precision)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 13)))
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))),
                                   tokens[:, :-1])["params"]
    loss, grads = loss_and_grads(cfg, params, tokens)
    loss_s, grads_s = loss_and_grads(cfg.replace(scan_layers=True, remat="full"),
                                     stack_layers(params, CFG.n_layers), tokens)
    np.testing.assert_allclose(float(loss_s), float(loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(stack_layers(grads, CFG.n_layers)), jax.tree.leaves(grads_s)):
        close(b, a, rtol=1e-4)


@pytest.mark.parametrize("precision", list(RECIPES))
def test_a_quantised_moe_model_trains_alike_under_every_dispatch(precision):
    """A mixture-of-experts model (4 experts, top-2, a shared expert) in each quantised
    precision, its grouped matmuls by the recipe: the dropless dispatch (sorted rows,
    scanned and rematerialised) and a capacity buffer that drops nothing (its padding
    rows zeros) give the same loss and gradients. Float32 sums in another order can move
    a value to its grid's other neighbour, so the gradients are held to a small part of
    the recipe's own effect (its distance from the default precision's)."""
    from tests.moe.test_experts import moe_cfg, wide_params
    cfg = moe_cfg(matmul_precision=precision)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 24)))
    params = wide_params(cfg, tokens)
    ragged = cfg.replace(scan_layers=True, remat="full")
    capacity = cfg.replace(moe=cfg.moe.replace(dispatch="capacity", capacity_factor=2.0))
    loss, grads = loss_and_grads(ragged, stack_layers(params, cfg.n_layers), tokens)
    want, want_grads = loss_and_grads(capacity, params, tokens)
    plain = loss_and_grads(cfg.replace(matmul_precision="default"), params, tokens)[1]
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    grads, want_grads, plain = flat(grads), flat(stack_layers(want_grads, cfg.n_layers)), \
        flat(stack_layers(plain, cfg.n_layers))
    effect = np.linalg.norm(want_grads - plain)
    assert effect > 1e-3 * np.linalg.norm(plain)  # the recipe ran
    assert np.linalg.norm(grads - want_grads) < 0.1 * effect, \
        np.linalg.norm(grads - want_grads) / effect


@pytest.mark.parametrize("precision", list(MATMUL_PRECISIONS))
def test_a_rows_logits_depend_on_other_rows_as_the_table_says(precision):
    """Row 0's logits alone and beside 15 other rows: equal up to float32 sums where the
    entry is batch_invariant (its scales per row or none), moved by the other rows'
    values where not (fp8's scales per tensor; beside two rows, row 0 held every tensor's
    amax in about 1 draw of 200, and nothing moved)."""
    cfg = CFG.replace(matmul_precision=precision)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (16, 12)))
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))),
                                   tokens)["params"]
    logits = jax.jit(lambda t: Transformer(cfg).apply({"params": params}, t))
    alone, beside = np.asarray(logits(tokens[:1])[0]), np.asarray(logits(tokens)[0])
    moved = np.abs(beside - alone).max() / np.abs(alone).max()
    if MATMUL_PRECISIONS[precision].batch_invariant:
        assert moved < 1e-4, moved
    else:
        assert moved > 1e-3, moved


@pytest.mark.parametrize("precision", [p for p in RECIPES
                                       if MATMUL_PRECISIONS[p].batch_invariant])
def test_a_batch_invariant_recipe_decodes_its_full_forwards_greedy_tokens(precision):
    """KV-cached greedy decoding (the prompt in one pass, then a token a step) gives the
    argmax of the full forward over the finished rows at every step, up to a near-tie, and
    each token's log-prob as that forward gives it: each token's scales are its own, so a
    one-token step quantises it as the whole sequence does. Over 6 draws the log-probs
    differed by at most 1e-6 (fp8_rowwise, int8); fp8's per-tensor scales part them by
    0.1-0.35, and 7 of 10 of its tokens agreed in one draw. In about 1 draw of 100 a value
    lies on a rounding boundary of the grid and the two programs' float32 sums put it on
    either side: a log-prob moved by 2e-3 to 2.5e-2 (JAXFORMER_TEST_SEED=258 for
    fp8_rowwise), a key in the cache so the rest of its row's (181, int8: by up to 1.5e-2,
    and a greedy token where the top two were 0.011 apart). So the row's positions after
    one may move, by under 0.05 (a token split within it), and at least half stay put
    (fp8_rowwise's activations scaled per tensor fail it)."""
    cfg = CFG.replace(matmul_precision=precision)
    prompts = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
    params = jax.tree.map(lambda x: x * 3.0, Transformer(cfg).init(  # sharp, varied
        jax.random.key(int(rng.integers(1 << 30))), prompts)["params"])
    out = generate(Transformer(cfg), params, prompts, max_new_tokens=10,
                   rng=jax.random.key(0), temperature=0.0)
    rows = jnp.concatenate([prompts, out.tokens], axis=1)
    logits = jax.jit(Transformer(cfg).apply)({"params": params}, rows[:, :-1])
    logits = logits[:, prompts.shape[1] - 1:]  # [B, 10, V]: those of the new tokens
    assert_greedy_up_to_near_ties(out.tokens, logits, tie=0.05)
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), out.tokens[..., None], -1)[..., 0]
    moved = np.abs(np.asarray(out.logprobs) - np.asarray(want))
    assert np.median(moved) < 1e-4 and moved.max() < 0.05, moved


def test_unknown_matmul_precision_names_the_choices():
    with pytest.raises(ConfigError, match="model.matmul_precision='fp4' is not one of "
                       "default, float32, bf16, fp8, fp8_rowwise, int8"):
        ModelConfig(matmul_precision="fp4")


def test_quantised_precisions_on_eight_devices_equal_one(tmp_path):
    """Each quantised entry (RECIPES: fp8, fp8_rowwise, int8) on a (data 2, fsdp 2, tensor
    2) mesh against one device, in one subprocess."""
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), SEED=str(int(rng.integers(1 << 30))))
    proc = subprocess.run([sys.executable, "-m", "tests.core.low_precision_worker", str(out),
                           *RECIPES], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["devices"] == 8
    f32_g = np.asarray(res["float32"]["grads"])
    for precision in RECIPES:
        one, mesh = res[precision]["one"], res[precision]["mesh"]
        np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=1e-5, err_msg=precision)
        # float32 sums in another order can put a value on the fp8 grid's other neighbour, and
        # that flip moves the gradients after it (~200 of 21k values by up to 1e-3 of the
        # largest, in 3 of 8 draws). So the mesh's gradient is held to a small part of the
        # recipe's own effect (fp8 against float32, ~2% of the gradient): flips gave <= 4% of
        # it over 16 draws, then 0 in 23 of 24 more and 6% in one; 20% once (SEED of the test
        # seed 113093449: a flip early in the chain); every scale 1.0001x on the mesh gives
        # 40%, and 0.8x 130%
        one_g, mesh_g = np.asarray(one["grads"]), np.asarray(mesh["grads"])
        effect = np.linalg.norm(one_g - f32_g)
        assert effect > 1e-3 * np.linalg.norm(f32_g), precision  # the recipe ran
        assert np.linalg.norm(mesh_g - one_g) < 0.3 * effect, precision


def chain_batches(n: int, batch: int = 16, t: int = 16):
    """n batches of a learnable text: each row follows a random permutation of the vocabulary
    from a random first token (the model learns the bigram table)."""
    perm = rng.permutation(CFG.vocab_size)
    out = []
    for _ in range(n):
        x = np.empty((batch, t + 1), np.int32)
        x[:, 0] = rng.integers(0, CFG.vocab_size, batch)
        for i in range(t):
            x[:, i + 1] = perm[x[:, i]]
        out.append(dict(inputs=x[:, :-1], targets=x[:, 1:], loss_mask=np.ones((batch, t), F32)))
    return out


def train_losses(cfg, data, seed: int):
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=2), cfg, len(data))
    state, step = init_state(model, tx, seed), make_train_step(model, tx, schedule)
    losses = []
    for b in data:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses


def test_fp8_trains_like_bf16():
    """20 steps of a bfloat16 model, its matmuls in fp8 and not, on the same data from the
    same init: both learn (the loss falls below 0.6 of its start), and fp8's last three
    steps' loss is within 2% of bf16's. Measured over seeds: within 0.1% (the 200-step
    runs of bench/low_precision.py: the issue's 2%); a planted recipe bug is far outside."""
    cfg = CFG.replace(dtype="bfloat16", scan_layers=True, matmul_precision="default")
    data, seed = chain_batches(20), int(rng.integers(1 << 16))
    bf16 = train_losses(cfg, data, seed)
    fp8 = train_losses(cfg.replace(matmul_precision="fp8"), data, seed)
    assert np.mean(bf16[-3:]) < 0.6 * bf16[0]
    np.testing.assert_allclose(np.mean(fp8[-3:]), np.mean(bf16[-3:]), rtol=0.02)


def test_an_fp8_run_resumes_bitwise(corpus, tmp_path):  # noqa: F811
    """configs/tiny.yaml with model.matmul_precision=fp8 (current scaling: each matmul's
    scales come from its operands, so the checkpoint's params and optimizer state are all
    the state there is), resumed from step 3's checkpoint, repeats the uninterrupted run's
    losses, params and optimizer state bit for bit."""
    same = ("model.matmul_precision=fp8", "train.steps=6", "checkpoint.every=3",
            "train.eval_every=100", "train.sample_tokens=0")
    cfg, _, straight, resumed = resumed_like_straight(lambda d: config(corpus, d, *same),
                                                      tmp_path)
    same_saved_state(cfg, straight, resumed)
