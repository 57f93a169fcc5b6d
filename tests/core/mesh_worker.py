"""Runs in a subprocess with 8 fake CPU devices (tests/core/test_sharding.py starts it):
python -m tests.core.mesh_worker TASK[,TASK...] OUT_JSON. Prints nothing; writes its
findings as JSON: one task's as they are; several tasks' as {task: its findings, or
{"error": its traceback}}, run one after another in this one process (one JAX start, and
the tasks that train on the same mesh share its compiled step)."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer import ModelConfig, Transformer, generate  # noqa: E402
from jaxformer.core.sharding import (batch_sharding, make_mesh, param_shardings,  # noqa: E402
                                     per_device_bytes, place_batch, process_rows, resolve_rules,
                                     traced_under)
from jaxformer.training.checkpoint import Checkpointer, abstract_like  # noqa: E402
from jaxformer.training.optim import OptimConfig  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.step import init_state, make_train_step, state_shardings  # noqa: E402
from tests.conftest import DEFAULT_EMITTERS  # noqa: E402

MESHES = [(8, 1, 1), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 1, 1, 4)]
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=16, ffn="swiglu", d_ff=64, norm="rmsnorm", scan_layers=True,
                  position="t5", t5_num_buckets=8, t5_max_distance=12,  # a learned bias
                  qkv_bias=False)  # a key bias is a no-op without RoPE: its update is noise
BATCH = 16
RULES = resolve_rules()


def spec_of(x):
    """A sharding's spec as a list of mesh-axis lists, one per dim."""
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return [[] if a is None else [a] if isinstance(a, str) else list(a) for a in spec]


def flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def setup(mesh, optim="adamw"):
    """(model, optimizer, initial state, jitted train step, batch placer) of CFG on `mesh`
    (None: one device)."""
    model, tx, step, place = _programs(CFG, mesh, optim)
    if mesh is None:
        return model, tx, init_state(model, tx, 0), step, place
    return model, tx, init_state(model, tx, 0, mesh=mesh, rules=RULES), step, place


@functools.lru_cache(maxsize=None)
def _programs(cfg, mesh, optim):
    """(model, optimizer, jitted train step, batch placer), one per config, mesh and
    optimizer in this process: a second task on a mesh reuses the first's compiled step."""
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(name=optim, lr=1e-2, warmup_steps=1), cfg, 10)
    if mesh is None:
        return model, tx, make_train_step(model, tx, schedule, grad_accum=2), lambda b: b
    shardings = state_shardings(model, tx, mesh, RULES)
    step = make_train_step(model, tx, schedule, grad_accum=2, mesh=mesh, rules=RULES,
                           shardings=shardings)
    bs = batch_sharding(mesh, RULES)
    rows = process_rows(bs, BATCH)
    return model, tx, step, lambda b: place_batch({k: v[rows] for k, v in b.items()}, bs, BATCH)


def batches():
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    out = []
    for _ in range(3):
        tokens = rng.integers(0, CFG.vocab_size, (BATCH, CFG.max_seq_len + 1)).astype(np.int32)
        out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                        loss_mask=(rng.random((BATCH, CFG.max_seq_len)) < 0.9).astype(np.float32)))
    return out


def losses():
    """3 steps on one device and on each mesh: losses, params, shardings, bytes; and with
    Muon (optim.name=muon) on one device and on (2, 2, 2)."""
    res = {}
    runs = [(shape, "adamw") for shape in [None] + MESHES] + [(None, "muon"), ((2, 2, 2), "muon")]
    for shape, optim in runs:
        mesh = None if shape is None else make_mesh(*shape)
        model, _, state, step, place = setup(mesh, optim)
        start = {k: np.asarray(v) for k, v in flat(state.params).items()}
        ls, skipped = [], []
        for b in batches():
            state, m = step(state, place(b))
            ls.append(float(m["loss"]))
            skipped.append(int(m["skipped"]))
        params = flat(state.params)
        res[str(shape) if optim == "adamw" else f"{optim} {shape}"] = dict(
            losses=ls, skipped=skipped,
            moved=max(float(np.abs(np.asarray(v) - start[k]).max()) for k, v in params.items()),
            params={k: np.asarray(v).ravel().tolist() for k, v in params.items()},
            specs={k: spec_of(v) for k, v in params.items()} if mesh else None,
            opt_specs={k: spec_of(v) for k, v in flat(state.opt_state).items() if v.ndim}
            if mesh else None,
            shapes={k: list(v.shape) for k, v in params.items()},
            bytes=per_device_bytes(state.params),
            shard_shapes={k: list(v.addressable_shards[0].data.shape) for k, v in params.items()})
    return res


def checkpoint():
    """Save under (2, 2, 2) (the step losses compiled); restore under (1, 8, 1), (8, 1, 1)
    and one device."""
    import tempfile
    model, tx, state, step, place = setup(make_mesh(2, 2, 2))
    for b in batches()[:1]:
        state, _ = step(state, place(b))
    saved = jax.tree.map(np.asarray, state)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d, keep=1, async_save=False)
        ck.save(1, state, CFG)
        ck.wait()
        for name, mesh in [("(1, 8, 1)", make_mesh(1, 8, 1)), ("(8, 1, 1)", make_mesh(8, 1, 1)),
                           ("one device", make_mesh(1, 1, 1, devices=jax.devices()[:1]))]:
            target = init_state(model, tx, 1, mesh=mesh, rules=RULES)  # other values
            restored = ck.restore(abstract_like(target), CFG)
            diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in
                       zip(jax.tree.leaves(restored), jax.tree.leaves(saved)))
            same_sharding = all(a.sharding == b.sharding for a, b in
                                zip(jax.tree.leaves(restored), jax.tree.leaves(target)))
            res[name] = dict(max_abs_diff=diff, same_sharding=same_sharding,
                             devices=len(jax.tree.leaves(restored.params)[0].sharding.device_set),
                             step=int(restored.step))
        ck.close()
    return res


def decode():
    """Greedy and sampled decoding with tensor-parallel (and FSDP) params equal one device."""
    model = Transformer(CFG)
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        jnp.zeros((1, 4), jnp.int32))["params"]
    prompts = rng.integers(1, CFG.vocab_size, (3, 5)).astype(np.int32)
    lengths = np.array([5, 3, 4], np.int32)
    kw = dict(prompt_lengths=lengths, max_new_tokens=8, rng=jax.random.key(3))
    ref_g = generate(model, params, prompts, temperature=0.0, **kw)
    ref_s = generate(model, params, prompts, temperature=1.0, top_k=10, **kw)
    res = {}
    for shape in [(1, 1, 8), (1, 2, 4)]:
        mesh = make_mesh(*shape)
        sharded = jax.device_put(params, param_shardings(model, mesh, RULES))
        g = generate(model, sharded, prompts, temperature=0.0, **kw)
        s = generate(model, sharded, prompts, temperature=1.0, top_k=10, **kw)
        res[str(shape)] = dict(
            greedy_equal=bool(np.array_equal(g.tokens, ref_g.tokens)),
            greedy_logprob_diff=float(np.max(np.abs(np.asarray(g.logprobs - ref_g.logprobs)))),
            sampled_equal=bool(np.array_equal(s.tokens, ref_s.tokens)),
            lengths_equal=bool(np.array_equal(g.lengths, ref_g.lengths)),
            query_spec=spec_of(sharded["blocks"]["attn"]["query"]["kernel"]))
    return res


def splash():
    """attention_impl='splash' under shard_map on meshes that split rows and heads (with
    GQA heads that tensor=4 cannot split: query heads then stay whole): logits and
    gradients of a packed, padded batch against the reference backend on one device."""
    return like_one_device(CFG.replace(position="rope", attention_impl="splash",
                                     sliding_window=6))


def patterns():
    """A Gemma 3-like layer pattern (a local window and two RoPE bases, scanned as data),
    QK-norm over the whole projection (its heads split over tensor), sandwich norms with
    Gemma's 1 + w, partial rotary, both soft-caps and attention sinks (split over tensor
    with the heads), blockwise with remat: as splash."""
    return like_one_device(CFG.replace(
        position="rope", norm="rmsnorm_offset", block="sandwich", qk_norm="projection",
        rope_fraction=0.5, attn_softcap=2.0, final_softcap=5.0, attn_sinks=True,
        attention_impl="blockwise",
        remat="full", layer_pattern=("local", "global"),
        layer_kinds={"local": {"window": 4, "rope_theta": 100.0}, "global": {}},
        lora={"rank": 2, "targets": ("query", "out", "wi_up")}))


def like_one_device(cfg):
    """cfg's logits and gradients of a packed, padded batch on meshes (2, 1, 4), (2, 2, 2)
    and (8, 1, 1) against the reference backend's on one device."""
    from jaxformer.positions import segment_positions

    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    tokens = rng.integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    seg = np.where(np.arange(16) < rng.integers(4, 12, (8, 1)), 1, 2)
    seg[:, -int(rng.integers(1, 4)):] = 0  # padding at the end of every row
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    w = rng.standard_normal((8, 16, cfg.vocab_size)).astype(np.float32) * (seg > 0)[..., None]
    batch, real = (tokens, pos, seg, w), seg > 0
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens[:1])["params"]
    ref, ref_grads = _reference(cfg.replace(remat="none"))(params, *batch)
    res = {}
    for shape in [(2, 1, 4), (2, 2, 2), (8, 1, 1)]:
        mesh = make_mesh(*shape)
        sharded = jax.device_put(params, param_shardings(model, mesh, RULES))
        step = jax.jit(traced_under(mesh, RULES, functools.partial(weighted_grad, cfg)))
        logits, grads = step(sharded, *batch)
        res[str(shape)] = dict(
            logits_diff=float(np.max(np.abs(np.asarray(logits)[real] - np.asarray(ref)[real]))),
            **grad_findings(grads, ref_grads),
            shard_map="manual_computation" in step.lower(sharded, *batch).as_text())
    return res


# (position scheme, window, mesh (data, fsdp, tensor, context), strategy, other settings):
# the ring on every scheme and mesh the issue names, the all-gather strategy on two of them
CONTEXT_MESHES = [(2, 1, 1, 4), (1, 1, 1, 8), (1, 1, 2, 4)]
# RoPE (with sinks) on every mesh, each bias scheme on one of them; Hunyuan's QK-norm
# after the rotation, Apertus's xIELU FFN (its learned scalars) and Llama 4's L2 QK-norm
# beside some of them
VARIANTS = [{}, {"qk_norm": "head_after_rope"}, {}, {"ffn": "xielu", "qk_norm": "l2"},
            {"ffn": "xielu"}, {}]
CONTEXT_CASES = ([(c, w, m, s, v) for (c, w, m, s), v in zip(
    [("rope", 5, m, "ring") for m in CONTEXT_MESHES]
    + [(p, w, m, "ring") for (p, w), m in zip([("alibi", None), ("t5", None), ("fire", 6)],
                                              CONTEXT_MESHES[::-1])], VARIANTS)]
    + [("rope", 5, (1, 1, 2, 4), "all_gather", {}), ("alibi", 7, (2, 1, 1, 4), "all_gather", {}),
       ("rope mla", None, (2, 1, 1, 4), "ring", {})])  # MLA: values narrower than keys
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)


def context():
    """Context parallelism (jaxformer.attention.ring): a model's logits and every param's
    gradient on a packed, padded batch in zigzag order, on each CONTEXT_CASES mesh, against
    the reference backend on one device in natural order (one compiled reference per
    config: the strategies and meshes of a scheme share it); and which collectives the
    compiled step runs (at the tests' XLA flags: the fusion emitters change the fusions,
    not the collectives)."""
    from jaxformer.attention.ring import zigzag_order

    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t, res = 32, {}
    for case, window, shape, strategy, variant in CONTEXT_CASES:
        position, mla = case.split()[0], "mla" in case
        cfg = CFG.replace(position=position, sliding_window=window, max_seq_len=t,
                          attention_impl=strategy, scan_layers=False, n_layers=1,
                          attn_sinks=case == "rope",  # the sinks merged by the ring
                          **(dict(mla=MLA, n_kv_heads=None, head_dim=None) if mla else {}),
                          **variant)
        batch = packed_batch(rng, cfg.vocab_size, t)  # tokens, positions, segments, w
        model = Transformer(cfg)
        params = model.init(jax.random.key(int(rng.integers(1 << 30))), batch[0][:, :8])
        params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype),
                              params["params"])
        ref, ref_grads = _reference(cfg)(params, *batch)
        mesh = make_mesh(*shape[:3], context=shape[3])
        order = zigzag_order(t, shape[3])
        zigzag = [x[:, order] for x in batch]
        sharded = jax.device_put(params, param_shardings(model, mesh, RULES))
        step = jax.jit(traced_under(mesh, RULES, functools.partial(weighted_grad, cfg)))
        step = step.lower(sharded, *zigzag).compile()
        logits, grads = step(sharded, *zigzag)
        real = zigzag[2] > 0
        res[f"{case} {shape} {strategy}"] = dict(
            logits_diff=float(np.max(np.abs(np.asarray(logits)[real] -
                                            np.asarray(ref)[:, order][real]))),
            **grad_findings(grads, ref_grads), **context_collectives(step.as_text(), t))
    res["loss_sums"] = context_loss_sums(rng)
    res["scanned"] = scanned_context_ranks(cfg.replace(scan_layers=True, remat="full",
                                                       n_layers=2), mesh, *zigzag)
    return res


def packed_batch(rng, vocab, t):
    """Two rows of two packed documents and end padding (segment ids 0), their positions,
    and weights w [2, T, vocab] (zero on the padding) for a loss sum(w * logits)."""
    from jaxformer.positions import segment_positions

    tokens = rng.integers(0, vocab, (2, t)).astype(np.int32)
    seg = np.where(np.arange(t) < rng.integers(6, t - 6, (2, 1)), 1, 2).astype(np.int32)
    seg[:, -int(rng.integers(1, 4)):] = 0
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    w = rng.standard_normal((2, t, vocab)).astype(np.float32) * (seg > 0)[..., None]
    return tokens, pos, seg, w


def weighted_grad(cfg, params, tokens, pos, seg, w):
    """(logits [B, T, V], the gradient of sum(w * logits)) of cfg's model."""
    def loss(p):
        logits = Transformer(cfg).apply({"params": p}, tokens, positions=pos, segment_ids=seg)
        return jnp.sum(w * logits), logits
    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


@functools.lru_cache(maxsize=None)
def _reference(cfg):
    """weighted_grad with the reference backend on one device, jitted once per config."""
    return jax.jit(functools.partial(weighted_grad, cfg.replace(attention_impl="reference")))


def grad_findings(grads, ref_grads):
    """The largest difference of any param's gradient, and the reference's largest one."""
    return dict(
        grad_diff=max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                      for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))),
        grad_scale=max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref_grads)))


def context_collectives(hlo, t):
    """The compiled program's collective-permutes, and the attention's own all-gathers
    along a dimension of the whole sequence's length t (XLA may still gather a K-sized
    gradient for a projection's weight gradient outside it, by its own cost model; with a
    bias the heads are gathered over tensor, not the sequence, and FIRE's [32, heads]
    weight along its heads)."""
    gathers = [m for line in hlo.splitlines() if "attn.attend" in line
               for m in re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(.*dimensions=\{(\d+)\}",
                                   line)
               if int(m[0].split(",")[int(m[1])]) == t]
    return dict(permutes=hlo.count("collective-permute-start(") + hlo.count("collective-permute("),
                attention_gathers=len(gathers))


def context_loss_sums(rng):
    """train.py's loss (jaxformer.training.step.loss_sums: zigzag order, then the ring) on
    mesh (data 2, context 4), of a packed, padded batch without positions (zigzag order
    must carry them), with RoPE and params of std 1 (peaked logits, near one-hot attention:
    a token, target, mask or position out of place changes the loss by percents); and the
    float64 loss of the reference backend's logits on one device, in natural order."""
    from jaxformer.core.sharding import sharding_context
    from jaxformer.training.step import loss_sums

    t = 32
    cfg = CFG.replace(position="rope", max_seq_len=t, attention_impl="ring", scan_layers=False)
    model = Transformer(cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype),
                          shapes["params"])
    tokens = rng.integers(0, cfg.vocab_size, (2, t + 1)).astype(np.int32)
    seg = np.where(np.arange(t) < rng.integers(6, 26, (2, 1)), 1, 2).astype(np.int32)
    seg[:, -int(rng.integers(1, 4)):] = 0
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg,
                 loss_mask=((rng.random((2, t)) < 0.8) & (seg > 0)).astype(np.float32))
    mesh = make_mesh(2, 1, 1, context=4)
    sharded = jax.device_put(params, param_shardings(model, mesh, RULES))
    with sharding_context(mesh, RULES):
        total, count = jax.jit(lambda p, b: loss_sums(model, p, b))(sharded, batch)
    reference = Transformer(cfg.replace(attention_impl="reference"))
    logits = jax.jit(lambda p: reference.apply({"params": p}, batch["inputs"],
                                               segment_ids=seg))(params)
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return dict(total=float(total), count=float(count),
                want=float(np.sum(nll * batch["loss_mask"])),
                want_count=float(batch["loss_mask"].sum()))


def scanned_context_ranks(cfg, mesh, tokens, pos, seg, w):
    """The ranks of the float arrays in a scanned, rematted model's compiled gradient on a
    context mesh (a batch in its zigzag order): blockwise keeps per-block logits only when
    it is differentiated through (a [steps, q blocks, k blocks, B, K, G, bq, bk] stack:
    rank 8) instead of by its VJP."""
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), tokens[:, :8])["params"]

    def loss(p):
        return jnp.sum(w * model.apply({"params": p}, tokens, positions=pos, segment_ids=seg))
    hlo = jax.jit(jax.grad(traced_under(mesh, RULES, loss))).lower(params)
    hlo = hlo.compile(DEFAULT_EMITTERS).as_text()
    return sorted({len(d.split(",")) for d in re.findall(r"= f32\[([\d,]+)\]", hlo)})


def study_eval():
    """The positions study's perplexity at 128 L (L = 16) with the sequence split over 8
    devices (mesh.context=8), against one device."""
    from jaxformer.experiments.positions import _evaluator, perplexity

    cfg = CFG.replace(position="alibi", max_seq_len=16 * 128, scan_layers=True, remat="full")
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    tokens = rng.integers(0, cfg.vocab_size, 2 * 16 * 128 + 1)
    res = {f"context {c}": perplexity(cfg, params, tokens, 16 * 128, 4096, c) for c in (1, 8)}
    batch = {k: jnp.zeros((2, 16 * 128), d) for k, d in (("inputs", jnp.int32),
             ("targets", jnp.int32), ("loss_mask", jnp.float32))}
    res["split"] = "manual_computation" in _evaluator(cfg, 8).lower(params, batch).as_text()
    return res


def grpo():
    """train.py's GRPO run (tests/training/test_grpo.py gives its args as JSON in
    GRPO_ARGS, a mesh among them): one jitted program per step on the mesh."""
    from jaxformer.training import load_config, train
    train(load_config(None, json.loads(os.environ["GRPO_ARGS"])), log=lambda *a: None)
    return {"devices": jax.device_count()}


TASKS = {"losses": losses, "grpo": grpo, "checkpoint": checkpoint, "decode": decode,
         "splash": splash, "patterns": patterns, "context": context, "study_eval": study_eval}


def main(tasks, out):
    """One task's findings, or several's by name (a task that raises: its traceback), to
    the JSON file `out`."""
    names = tasks.split(",")
    if len(names) == 1:
        res = TASKS[names[0]]()
    else:
        res = {}
        for name in names:
            try:
                res[name] = TASKS[name]()
            except Exception:  # the others still run; the tests reading it fail with this
                res[name] = {"error": traceback.format_exc()[-3000:]}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
