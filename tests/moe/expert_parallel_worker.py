"""Runs in a subprocess with 8 fake CPU devices (tests/moe/test_expert_parallel.py starts it):
python -m tests.moe.expert_parallel_worker OUT_JSON. Prints nothing; writes its findings as
JSON: a tiny mixture of experts' logits and gradients on expert meshes against the dense
reference dispatch on one device, train steps on two meshes against one device, and the
compiled train step's collectives."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer import ModelConfig, Transformer  # noqa: E402
from jaxformer.attention.ring import zigzag_order  # noqa: E402
from jaxformer.core.sharding import (batch_sharding, make_mesh, param_shardings,  # noqa: E402
                                     place_batch, process_rows, resolve_rules, sharding_context)
from jaxformer.training.optim import OptimConfig  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.step import init_state, make_train_step, state_shardings  # noqa: E402

# sizes chosen apart, so that a gathered expert kernel [E, D, F] is known by its shape:
# E 8, D 32, F 12 (6 over tensor 2); heads of 16, batch 8 x 16
E, D, F = 8, 32, 12
CFG = ModelConfig(vocab_size=64, d_model=D, n_layers=2, n_heads=2, n_kv_heads=2,
                  max_seq_len=16, ffn="swiglu", d_ff=40, norm="rmsnorm", position="rope",
                  qkv_bias=False,  # the key bias's gradient is ~0: Adam's step on it, noise
                  scan_layers=True, attention_impl="reference",
                  moe={"experts": E, "top_k": 2, "d_ff": F, "bias": True, "shared_experts": 1,
                       "shared_d_ff": 20, "aux_loss": 0.01})
# (data, fsdp, tensor, context, expert)
MESHES = {"data 2, expert 4": (2, 1, 1, 1, 4), "expert 8": (1, 1, 1, 1, 8),
          "fsdp 2, expert 2, tensor 2": (1, 2, 2, 1, 2),
          "expert 4, context 2": (1, 1, 1, 2, 4)}
NONE = (0, 4, 5)  # the experts that get no token in the second draw (a whole device's, at 4)
RULES = resolve_rules()


def mesh_of(shape):
    data, fsdp, tensor, context, expert = shape
    return make_mesh(data, fsdp, tensor, context=context, expert=expert)


def draws(rng, reference, init):
    """Two sets of params: `init` moved by N(0, 0.1), and the same with the router's bias
    at -100 for the NONE experts (they get none), drawn until every expert gets tokens in
    every layer in the first and every other expert in the second (the reference's loads:
    with NONE's tokens moved, one of the others can still get none)."""
    init = jax.tree.map(np.asarray, init)
    others = [e for e in range(CFG.moe.experts) if e not in NONE]
    for _ in range(50):
        params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype),
                              init)
        starved = jax.tree.map(np.copy, params)
        starved["blocks"]["ffn"]["router"]["bias"][:, list(NONE)] = -100.0  # [layers, E]
        if np.min(np.asarray(reference(params)[2])) > 0 and \
                np.min(np.asarray(reference(starved)[2])[:, others]) > 0:
            break
    else:
        raise RuntimeError("no draw in 50 reached every expert")
    return {"every expert": params, "some get none": starved}


def logits_and_grads(out_path):
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    tokens = rng.integers(0, CFG.vocab_size, (8, 16)).astype(np.int32)
    w = rng.standard_normal((8, 16, CFG.vocab_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(16), (8, 16))

    def run(cfg, p, order):
        def loss(p):
            logits, state = Transformer(cfg).apply(
                {"params": p}, tokens[:, order], positions=pos[:, order], mutable=["moe"])
            return jnp.sum(w[:, order] * logits), (logits, state["moe"])
        (_, (logits, moe)), grads = jax.value_and_grad(loss, has_aux=True)(p)
        load = [v for k, v in jax.tree_util.tree_leaves_with_path(moe)
                if "load" in jax.tree_util.keystr(k)]
        return logits, grads, load[0]  # [layers, E]: assignments per expert

    natural = np.arange(16)
    dense = CFG.replace(moe=dataclasses.replace(CFG.moe, dispatch="dense"))  # the reference
    reference = jax.jit(lambda p: run(dense, p, natural))
    model = Transformer(CFG)
    tx, schedule = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), CFG, 10)
    initial = init_state(model, tx, 0)  # one device's; train_steps starts from it too
    sets = draws(rng, reference, initial.params)
    refs = {draw: reference(params) for draw, params in sets.items()}
    res = {draw: dict(load=np.asarray(refs[draw][2]).tolist(), meshes={}) for draw in sets}
    for name, shape in MESHES.items():
        mesh, order = mesh_of(shape), zigzag_order(16, shape[3]) if shape[3] > 1 else natural

        def body(p):
            with sharding_context(mesh, RULES):  # the sequence split: ring attention
                return run(CFG.replace(attention_impl="ring") if shape[3] > 1 else CFG, p, order)
        where = param_shardings(Transformer(CFG), mesh, RULES)
        compiled = jax.jit(body).lower(jax.device_put(sets["every expert"], where)).compile()
        hlo = compiled.as_text()
        for draw, params in sets.items():
            logits, grads, _ = refs[draw]
            got, got_grads, _ = compiled(jax.device_put(params, where))
            res[draw]["meshes"][name] = dict(
                logits=rel(np.asarray(got), np.asarray(logits)[:, order]),
                grads={jax.tree_util.keystr(k): rel(np.asarray(a), np.asarray(b)) for (k, a), b
                       in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                              jax.tree.leaves(grads))},
                all_to_all=hlo.count("all-to-all("), gathers=gathered_shapes(hlo))
    res["train"] = train_steps(rng, model, tx, schedule, initial)
    json.dump(res, open(out_path, "w"))


def rel(a, b):
    """Largest difference over the reference's largest magnitude."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def train_steps(rng, model, tx, schedule, state):
    """3 steps of the training loop's step (grad_accum 2) on one device and on mesh
    (data 2, expert 4), both from `state` (the mesh's a copy placed by its shardings):
    losses, the params' difference, the compiled step's collectives."""
    batches = []
    for _ in range(3):
        toks = rng.integers(0, CFG.vocab_size, (16, 17)).astype(np.int32)
        batches.append(dict(inputs=toks[:, :-1], targets=toks[:, 1:],
                            loss_mask=(rng.random((16, 16)) < 0.9).astype(np.float32)))
    mesh = mesh_of(MESHES["data 2, expert 4"])
    shardings = state_shardings(model, tx, mesh, RULES)
    st = jax.device_put(jax.tree.map(np.asarray, state), shardings)
    step = make_train_step(model, tx, schedule, grad_accum=2)
    ref = []
    for b in batches:
        state, m = step(state, b)
        ref.append(float(m["loss"]))
    bs = batch_sharding(mesh, RULES)
    rows = process_rows(bs, 16)
    place = lambda b: place_batch({k: v[rows] for k, v in b.items()}, bs, 16)  # noqa: E731
    jitted = make_train_step(model, tx, schedule, grad_accum=2, mesh=mesh, rules=RULES,
                             shardings=shardings)
    # compiled with the tests' flags: XLA's fusion emitters (DEFAULT_EMITTERS) change the
    # fusions, not the collectives, and take 4x as long here
    compiled = jitted.lower(st, place(batches[0])).compile()
    losses = []
    for b in batches:
        st, m = compiled(st, place(b))
        losses.append(float(m["loss"]))
    hlo = compiled.as_text()
    return dict(one_device=ref, losses=losses, params=max(
        rel(np.asarray(a), np.asarray(b)) for a, b in
        zip(jax.tree.leaves(st.params), jax.tree.leaves(state.params))),
        all_to_all=hlo.count("all-to-all("), gathers=gathered_shapes(hlo))


def gathered_shapes(hlo):
    """The result shapes of the program's all-gathers, as lists of dims."""
    return [[int(d) for d in dims.split(",") if d] for dims in
            re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)]


if __name__ == "__main__":
    logits_and_grads(sys.argv[1])
