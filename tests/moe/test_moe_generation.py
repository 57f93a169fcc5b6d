"""A mixture-of-experts model beyond training: the KV-cached decoder, beam search and
speculative decoding (the properties of tests/decode/test_loops.py and
tests/decode/test_speculative.py, run on sparse models), int8 and bfloat16 experts against a
float64 NumPy forward, the routing hooks and an ablated expert, and LoRA beside the
experts. Fresh random weights (std ~0.1: routing differs token to token) every run."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxformer import Transformer, stack_layers
from jaxformer.core.matmul import Int8Kernel
from jaxformer.decode import generate
from jaxformer.model import lora
from jaxformer.model.config import ConfigError
from jaxformer.model.inspect import run_with_cache, run_with_hooks
from jaxformer.model.kinds import FFNS
from jaxformer.model.quantize import dequantize, quantize
from jaxformer.moe.experts import DISPATCHES
from tests.conftest import DEFAULT_EMITTERS
from tests.decode import test_loops as td
from tests.decode import test_speculative as ts
from tests.model import test_transformer as tm
from tests.moe import test_experts as tmoe

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
SPARSE = dict(ffn="swiglu", norm="rmsnorm", use_bias=False)
MOES = {"routed": dict(experts=4, top_k=2, d_ff=24),
        "shared": dict(experts=8, top_k=2, d_ff=16, shared_experts=1, shared_gate=True)}


def sparse_cfg(moe="routed", **kw):
    """tests/model/test_transformer.py's small config, sparse: moe a name in MOES or a model.moe."""
    return tm.small(**{**SPARSE, "moe": MOES[moe] if isinstance(moe, str) else moe, **kw})


def sparse_init(cfg, batch=2, seq=11):
    """(tokens, params) of an unscanned model: init (jitted: eager, it runs op by op) plus
    N(0, 0.1) on every param, as tests/model/test_transformer.py's init draws them."""
    cfg = cfg.replace(scan_layers=False)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)))
    init = jax.jit(Transformer(cfg).init)
    params = init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    return tokens, jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32),
                                params)


@pytest.fixture
def sparse_tests(monkeypatch, rng):
    """use(module, moe): module's make (tests/decode/test_loops.py's or test_speculative.py's)
    builds the MoE model `moe` of MOES, a swiglu RMSNorm one, and draws from this test's
    rng, so that its tests run as they are on a sparse model."""
    def use(module, moe):
        make = module.make
        monkeypatch.setattr(module, "make", lambda *a, **kw: make(
            *a, **{**SPARSE, "moe": MOES[moe], **kw}))
        monkeypatch.setattr(module, "rng", rng)
    return use


# ---- the float64 reference: tests/model/test_transformer.py's forward with sparse layers -------------

def np_sparse_ffn(cfg, p, x, out=None, pre=""):
    """A sparse layer's output in float64 (a dense one's: tests/model/test_transformer.py's), and its
    routing recorded under our hook names: router logits, chosen experts, weights."""
    if "router" not in p:
        return NP_DENSE_FFN(cfg, p, x, out, pre)
    b, t, d = x.shape
    h = x.reshape(-1, d)
    logits = tm.keep(out, pre + "gate.hook_out", (h @ p["router"]["kernel"]).reshape(b, t, -1))
    weights, experts = tmoe.np_route(logits.reshape(b * t, -1), cfg.moe)
    tm.keep(out, pre + "hook_expert_indices", experts.reshape(b, t, -1))
    every = (np.eye(cfg.moe.experts)[experts] * weights[..., None]).sum(-2)  # [N, E]
    tm.keep(out, pre + "hook_expert_weights", every.reshape(b, t, -1))
    w = {k: v for k, v in p.items() if k in ("wi", "wi_gate", "wi_up", "wo")}
    y = tmoe.np_moe(h, weights, experts, w, cfg.ffn).reshape(b, t, d)
    if "shared" in p:
        shared = NP_DENSE_FFN(cfg, p["shared"], x)
        if "shared_gate" in p:
            shared = shared / (1 + np.exp(-(x @ p["shared_gate"]["kernel"])))
        y = y + shared
    return y


NP_DENSE_FFN = tm.np_ffn


@pytest.fixture
def np_forward(monkeypatch):
    """tests/model/test_transformer.py's float64 forward, sparse layers included."""
    monkeypatch.setattr(tm, "np_ffn", np_sparse_ffn)
    return tm.np_forward


# ---- 1. decoding: the dense model's properties, on sparse models -------------------------

def test_cached_logits_equal_full_forward(sparse_tests):
    """Prefill then single-token steps through the cache == one full forward, position by
    position: scanned layers, shared experts, GQA and a sliding window of 5."""
    sparse_tests(td, "shared")
    td.test_cached_logits_equal_full_forward("rope", 2, True, "pre_ln")


def test_greedy_is_the_argmax_of_full_forwards(sparse_tests):
    """Ragged prompts, routed experts alone."""
    sparse_tests(td, "routed")
    td.test_greedy_equals_recompute_rollout_ragged("rope", 4, False, "pre_ln")


def test_capacity_is_a_training_option_decoding_runs_dropless():
    """With capacity_factor 0.5 the full forward drops assignments, and what a token gets
    hangs on the tokens beside it; decoding runs the experts dropless (generate, beam search
    and speculative decoding alike: jaxformer.decode.cached_forward.decoding_config): greedy
    tokens are the argmax of the dropless model's full forwards, log-probs its own."""
    cfg = sparse_cfg(vocab_size=37, max_seq_len=48, moe="shared")
    capped = cfg.replace(moe=cfg.moe.replace(capacity_factor=0.5))
    tokens, params = sparse_init(cfg, batch=3, seq=7)
    dropless, capacity = Transformer(cfg), Transformer(capped)
    assert np.abs(np.asarray(capacity.apply({"params": params}, tokens)) -
                  np.asarray(dropless.apply({"params": params}, tokens))).max() > 1e-3
    td.rng = rng
    prompts, lengths = td.ragged_prompts(3, 7, cfg.vocab_size)
    kw = dict(prompt_lengths=lengths, max_new_tokens=5, rng=jax.random.key(0),
              temperature=0.0)
    out = generate(capacity, params, prompts, **kw)
    td.assert_greedy_by_recompute(dropless, params, prompts, lengths, np.asarray(out.tokens))
    np.testing.assert_allclose(out.logprobs, td.continuation_logprobs(
        dropless, params, prompts, lengths, np.asarray(out.tokens)), rtol=1e-4, atol=1e-5)


def test_beam_search_equals_a_recomputed_beam_search(sparse_tests):
    """k = 4 beams over a vocabulary of 7, ragged prompts, an EOS, against beam search by
    its definition with full forwards; some rows' best is not greedy's."""
    sparse_tests(td, "shared")
    td.test_beam_search_equals_a_recomputed_beam_search(0.0)


def test_greedy_with_prompt_lookup_is_greedy(sparse_tests):
    """Speculative decoding verifies each row in its own cache, vmapped: the experts'
    grouped matmul batched over the rows with one set of kernels (jaxformer.moe.grouped_vmap).
    Prompt lookup's drafts, mostly refused, give the plain greedy tokens, log-probs and
    lengths, ragged rows with an EOS included."""
    sparse_tests(ts, "routed")
    ts.test_greedy_with_a_draft_is_greedy("alibi")


def test_the_model_as_its_own_draft_keeps_every_draft(sparse_tests):
    """A sparse draft equal to the model: its vmapped drafts are the model's greedy tokens,
    every one kept."""
    sparse_tests(ts, "shared")
    ts.test_the_model_as_its_own_draft_keeps_every_draft()


# ---- 2. int8 and bfloat16 experts ------------------------------------------------------

def np_dequantized(tree):
    """Every Int8Kernel as float64 values * scale; the rest as float64."""
    return jax.tree.map(lambda x: np.float64(x.values) * np.float64(x.scale)
                        if isinstance(x, Int8Kernel) else np.float64(x), tree,
                        is_leaf=lambda x: isinstance(x, Int8Kernel))


@pytest.mark.parametrize("dispatch", list(DISPATCHES))
def test_int8_experts_are_their_dequantized_weights_in_every_dispatch(dispatch):
    """Expert kernels [E, in, out] with biases, quantized: a scale per expert and output
    channel (its absmax / 127), and each dispatch (ragged: the scale gathered per row's
    expert) equals the float64 experts of values * scale."""
    n, d, f, n_experts, k = 24, 16, 8, 6, 2
    tmoe.rng = rng
    x = rng.normal(0, 1, (n, d)).astype(np.float32)
    weights, experts = tmoe.routing(n, n_experts, k, idle=(3,))
    w = tmoe.expert_weights(n_experts, d, f, True, True)
    q = quantize({"ffn": w}, "int8")["ffn"]
    for name in ("wi_gate", "wi_up", "wo"):
        assert isinstance(q[name], Int8Kernel) and q[name].values.dtype == jnp.int8
        np.testing.assert_allclose(q[name].scale, np.abs(w[name]).max(1, keepdims=True) / 127,
                                   rtol=1e-6)  # [E, 1, out]
        assert q[name + "_bias"] is w[name + "_bias"]
    y, _ = DISPATCHES[dispatch](jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), q,
                                FFNS["swiglu"], capacity_factor=None if dispatch != "capacity"
                                else 2.0 * n_experts)  # room for every assignment
    want = tmoe.np_moe(x, weights, experts, np_dequantized(q), "swiglu")
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights, moe, scan", [("int8", "routed", False), ("int8", "shared", True),
                                                ("bfloat16", "shared", False)])
def test_narrow_weights_are_the_models_they_stand_for(np_forward, weights, moe, scan):
    """A sparse model's int8 (per expert and channel) or bfloat16 experts, shared experts
    quantized as a plain feed-forward, the routers (router, shared_gate) kept float32: its
    logits against the float64 forward of the weights they stand for."""
    cfg = sparse_cfg(moe, scan_layers=scan)
    tokens, params = sparse_init(cfg)
    if scan:
        params = stack_layers(params, cfg.n_layers)
    q = quantize(params, weights)
    flat, before = flatten_dict(q), flatten_dict(params)
    lead = (cfg.n_layers,) if scan else ()
    for path, x in flat.items():
        if path[-1] in ("wi_gate", "wi_up", "wo"):  # an expert stack [(L,) E, in, out]
            narrow = x.values.dtype == jnp.int8 and x.scale.shape == (
                *lead, cfg.moe.experts, 1, before[path].shape[-1]) if weights == "int8" \
                else x.dtype == jnp.bfloat16
            assert narrow, path
        elif path[-2] in ("router", "shared_gate"):
            assert x.dtype == jnp.float32 and np.array_equal(x, before[path]), path
    tree = np_dequantized(q) if weights == "int8" else jax.tree.map(np.float64, q)
    if scan:
        from jaxformer.model.transformer import unstack_layers
        tree = unstack_layers(tree)
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": q}, tokens), np.float64)
    want = np_forward(cfg, tree, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's compiled loop")
@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_the_decode_loop_reads_narrow_experts(weights):
    """In the compiled generate the expert stacks [8, 32, 16] and [8, 16, 32] enter the
    decode loop in their own dtype, no widened float32 copy carried (tests/model/test_quantize.py
    checks the dense kernels so); the compiled decoder's greedy tokens are those of the
    float32 weights they stand for."""
    from jaxformer.decode.loops import _decoder
    from jaxformer.decode.sampling import Sampling, checked_sampling
    cfg = sparse_cfg("shared", vocab_size=37, max_seq_len=16, n_layers=1)
    tokens, params = sparse_init(cfg, batch=2, seq=3)
    q = quantize(params, weights)
    fn = _decoder(cfg, 4, None, 0, None, True)
    greedy = checked_sampling(Sampling(temperature=0.0), 2, cfg.vocab_size)
    args = (tokens, jnp.array([3, 2]), jax.random.key(0), greedy)
    compiled = fn.lower(q, *args).compile(DEFAULT_EMITTERS)
    states = [s for s in re.findall(r"= \((.*?)\) while\(", compiled.as_text())
              if "[8,32,16]" in s and "[8,16,32]" in s]  # the decode loop: every kernel
    narrow = "s8" if weights == "int8" else "bf16"
    assert states
    for carried in states:  # (the prefill's tile loops may widen theirs once, outside it)
        assert f"{narrow}[8,32,16]" in carried and f"{narrow}[8,16,32]" in carried, carried
        assert "f32[8,32,16]" not in carried and "f32[8,16,32]" not in carried, carried
    wide = dequantize(q) if weights == "int8" else jax.tree.map(jnp.float32, q)
    np.testing.assert_array_equal(compiled(q, *args).tokens,
                                  fn(wide, *args).tokens)


# ---- 3. hooks -----------------------------------------------------------------------------

ROUTING_HOOKS = ("gate.hook_out", "hook_expert_indices", "hook_expert_weights")


def test_routing_hooks_hold_the_float64_routing(np_forward):
    """run_with_cache's blocks.i.mlp.gate.hook_out (router logits [B, T, E]: TransformerLens
    4 calls the router gate), hook_expert_indices [B, T, k] and hook_expert_weights [B, T, E], scanned
    layers as the loop, against the float64 forward's routing."""
    cfg = sparse_cfg("shared", scan_layers=True)
    tokens, params = sparse_init(cfg)
    names = [f"blocks.{i}.mlp.{n}" for i in range(cfg.n_layers) for n in ROUTING_HOOKS]
    _, cache = run_with_cache(Transformer(cfg), stack_layers(params, cfg.n_layers), tokens,
                              names=names)
    want = {}
    np_forward(cfg, params, tokens, out=want)
    assert sorted(cache) == sorted(names)
    for name in names:
        if name.endswith("indices"):
            np.testing.assert_array_equal(cache[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(cache[name], want[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def ablation_hooks(cfg, expert: int):
    """Hooks that switch `expert` off in every layer: its column of the weights over every
    expert set to 0."""
    return {f"blocks.{i}.mlp.hook_expert_weights": lambda w: w.at[..., expert].set(0)
            for i in range(cfg.n_layers)}


def without_expert(cfg, params, expert: int):
    """The dense reference dispatch (every expert on every token) with `expert`'s output
    kernel at 0: the model with that expert removed, routing unchanged."""
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x.at[expert].set(0.0) if p[-1].key == "wo" and x.ndim == 3 else x, params)
    return Transformer(cfg.replace(moe=cfg.moe.replace(dispatch="dense"))), params


def test_ablating_an_expert_by_its_weight_is_the_model_without_it():
    """An expert's weight set to 0 by hooks equals the dense reference with that expert
    removed: the forward (run_with_hooks) and greedy decoding (generate's hooks, through
    the KV cache) alike; and it changes the output."""
    cfg = sparse_cfg("routed", vocab_size=37, max_seq_len=32)
    tokens, params = sparse_init(cfg)
    expert = int(rng.integers(cfg.moe.experts))
    model, hooks = Transformer(cfg), ablation_hooks(cfg, expert)
    ref, ref_params = without_expert(cfg, params, expert)
    got = np.asarray(run_with_hooks(model, params, tokens, hooks=hooks))
    want = np.asarray(jax.jit(ref.apply)({"params": ref_params}, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    clean = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    assert np.abs(clean - want).max() > 1e-3 * np.abs(want).max()
    prompts, lengths = np.asarray(tokens[:, :5]), np.array([5, 5])
    out = generate(model, params, prompts, max_new_tokens=6, rng=jax.random.key(0),
                   temperature=0.0, hooks=hooks)
    td.assert_greedy_by_recompute(ref, ref_params, prompts, lengths, np.asarray(out.tokens))


# ---- 5. LoRA beside the experts --------------------------------------------------------

def test_lora_on_attention_trains_beside_the_experts():
    """Adapters on the attention projections of a sparse model: partition puts them alone
    on the trained side (experts, router and shared experts frozen, bitwise), a few train
    steps on one batch lower its loss, and merge folds them in: the plain model with the
    merged weights gives the adapted model's logits."""
    import optax

    from jaxformer.training.step import TrainState, make_train_step, trained_part
    cfg = sparse_cfg("shared", lora={"rank": 2, "alpha": 4.0, "targets": "attention"})
    tokens, params = sparse_init(cfg, seq=13)
    params = jax.tree_util.tree_map_with_path(  # adapters as a new one's: B at 0
        lambda p, x: jnp.zeros_like(x) if p[-1].key == "lora_b" else x, params)
    adapters, base = jax.device_get(lora.partition(params))  # (the step donates the state)
    assert {k[-2] for k in flatten_dict(adapters)} == {"query_lora", "key_lora", "value_lora",
                                                      "out_lora"}
    tx = optax.apply_if_finite(optax.adam(3e-2), 5)  # as the train loop wraps it
    state = TrainState(step=jnp.zeros([], jnp.int32), params=params,
                       opt_state=tx.init(trained_part(params)[0]), rng=jax.random.key(0))
    step = make_train_step(Transformer(cfg), tx, lambda s: 0.0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": jnp.ones((2, 12), jnp.float32)}
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    moved, frozen = lora.partition(state.params)
    for (k, x), y in zip(flatten_dict(base).items(), flatten_dict(frozen).values()):
        assert np.array_equal(x, y), k
    assert any(np.abs(np.asarray(x)).max() > 0 for k, x in flatten_dict(moved).items()
               if k[-1] == "lora_b")
    merged = jax.tree.map(jnp.float32, lora.merge(state.params))
    plain = cfg.replace(lora=lora.LoRAConfig())
    np.testing.assert_allclose(
        np.asarray(Transformer(plain).apply({"params": merged}, tokens)),
        np.asarray(Transformer(cfg).apply({"params": state.params}, tokens)),
        rtol=1e-5, atol=1e-5)


def test_mlp_adapters_reach_the_shared_experts_alone():
    """The routed experts take no adapters: `mlp` adapts the shared experts of a sparse
    model and the dense layers beside sparse ones; on a model of routed experts alone it is
    refused in one line (`all` adapts its attention)."""
    def adapted(**kw):
        shapes = jax.eval_shape(Transformer(sparse_cfg(**kw)).init, jax.random.key(0),
                                jnp.zeros((1, 4), jnp.int32))["params"]
        return {"/".join(k[:-1]) for k in flatten_dict(lora.partition(shapes)[0])
                if k[-1] == "lora_a"}

    mlp = {"rank": 2, "targets": "mlp"}
    assert adapted(moe="shared", lora=mlp) == {f"block_{i}/ffn/shared/{n}_lora" for i in range(2)
                                               for n in ("wi_gate", "wi_up", "wo")}
    mixed = adapted(moe={**MOES["routed"], "layers": "1"}, lora=mlp, n_layers=3)
    assert {p.split("/")[0] for p in mixed} == {"block_0", "block_2"}
    assert all("attn" in p for p in adapted(moe="routed", lora={"rank": 2, "targets": "all"}))
    for targets in ("mlp", "query,wo"):
        with pytest.raises(ConfigError, match=r"^model.lora.targets names [^\n]*routed experts "
                           r"take no adapters; target attention[^\n]*shared_experts$"):
            sparse_cfg(moe="routed", lora={"rank": 2, "targets": targets})


# ---- 4. parity with TransformerLens ------------------------------------------------------

def test_routing_hooks_match_transformer_lens(tmp_path):
    """A random Mixtral (4 experts, top-2, weights at std 0.1) read by from_hf, and booted
    offline by TransformerLens 4's TransformerBridge from the same folder: each sparse
    layer's router logits (gate.hook_out), chosen experts and their weights, the layer's
    output and the logits are TransformerLens's. It fires the routing hooks per token
    [B T, ...]; ours [B, T, ...]."""
    pytest.importorskip("transformer_lens.model_bridge")
    import torch
    import transformers

    from jaxformer.convert import from_hf
    from tests.hf.test_families import random_hf_model, transformer_lens_bridge
    b, t, n_experts, k = 2, 9, 4, 2
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=n_experts, num_experts_per_tok=k, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    random_hf_model(config, int(rng.integers(1 << 31))).save_pretrained(tmp_path)
    bridge = transformer_lens_bridge(tmp_path, 64)
    tokens = rng.integers(0, 64, (b, t))
    their_logits, theirs = bridge.run_with_cache(torch.tensor(tokens))
    cfg, params = from_hf(tmp_path)
    names = [f"blocks.{i}.{n}" for i in range(2) for n in
             [f"mlp.{h}" for h in ROUTING_HOOKS] + ["hook_mlp_out"]]
    logits, ours = run_with_cache(Transformer(cfg), params, jnp.asarray(tokens), names=names)
    for name in names:
        want = theirs[name].detach().numpy()
        got = np.asarray(ours[name])
        got = got.reshape(want.shape)
        if name.endswith("indices"):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(logits), their_logits.detach().numpy(), rtol=1e-4,
                               atol=1e-5)
