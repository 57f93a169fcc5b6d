"""Multi-head latent attention (jaxformer.attention.mla, jaxformer.model.latent_attention): the expanded form
against a float64 NumPy definition, the backends and remat against the reference, the
absorbed KV-cached decoder against the full forward token by token, the cache's shapes,
and the refusals. Fresh random weights every run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ConfigError, ModelConfig, Transformer
from jaxformer.decode import generate, init_cache, kv_cache_bytes
from jaxformer.model import latent_attention as mla_attention
from jaxformer.model.transformer import stack_layers
from jaxformer.positions import segment_positions

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)  # v narrower than q/k (12), as DeepSeek's (128 against 192)


def make(mla=MLA, init=True, **kw):
    """(config, params): the model's init, norm scales and weights x 3 moved by N(0, 0.1);
    init False: the config alone."""
    cfg = ModelConfig(**{**dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4,
                                position="rope", norm="rmsnorm", ffn="swiglu", use_bias=False,
                                tie_embeddings=False, max_seq_len=64, mla=mla), **kw})
    if not init:
        return cfg
    init = Transformer(cfg.replace(scan_layers=False, attention_impl="reference"))
    params = init.init(jax.random.key(int(rng.integers(1 << 30))),
                       jnp.zeros((1, 4), jnp.int32))["params"]
    # random norm scales and larger weights: sharp, varied attention
    params = jax.tree.map(lambda x: x * 3.0 + 0.1 * rng.standard_normal(x.shape, np.float32),
                          params)
    if cfg.scan_layers:
        params = stack_layers(params, cfg.n_layers)
    return cfg, params


def np_rope(x, pos, theta=10000.0):
    """Half-rotation RoPE in float64 over x's last axis; x [B, T, ..., P], pos [B, T]."""
    half = x.shape[-1] // 2
    ang = pos[..., None].astype(np.float64) / theta ** (np.arange(half) * 2 / x.shape[-1])
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_mla(cfg, p, x, pos, allowed):
    """DeepSeek's MLA in float64, written from its definition: x [B, T, D] -> [B, T, D]."""
    m, f = cfg.mla, lambda a: np.asarray(a, np.float64)  # noqa: E731
    q = np.einsum("btd,dr->btr", x, f(p["q_down"]["kernel"]))
    q = np.einsum("btr,rnh->btnh", np_rms(q, f(p["q_down_norm"]["scale"]), cfg.norm_eps),
                  f(p["q_up"]["kernel"]))
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], np_rope(q[..., m.qk_nope_head_dim:], pos)
    ckv = np.einsum("btd,dr->btr", x, f(p["kv_down"]["kernel"]))
    c = np_rms(ckv[..., :m.kv_lora_rank], f(p["kv_norm"]["scale"]), cfg.norm_eps)
    k_rope = np_rope(ckv[..., m.kv_lora_rank:], pos)  # [B, T, P]: one for every head
    k_nope = np.einsum("btr,rnh->btnh", c, f(p["key_up"]))
    v = np.einsum("btr,rnh->btnh", c, f(p["value_up"]))
    s = (np.einsum("btnh,bsnh->bnts", q_nope, k_nope)
         + np.einsum("btnh,bsh->bnts", q_rope, k_rope)) / np.sqrt(m.qk_head_dim)
    s = np.where(allowed[:, None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    z = np.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)
    return np.einsum("btnh,nhd->btd", z, f(p["out"]["kernel"]))


def test_expanded_form_matches_float64_definition():
    """One MLA layer (low-rank query, latent RMSNorm, RoPE on the decoupled slice, values
    narrower than keys) on a packed batch against the float64 definition."""
    import flax.linen as nn

    from jaxformer.attention.masks import MaskRule
    from jaxformer.model.latent_attention import MLAttention
    cfg = make(n_layers=1, init=False)
    layer = MLAttention(cfg, impl="reference")
    x = rng.standard_normal((2, 10, cfg.d_model)).astype(np.float32)
    seg = np.array([[1] * 6 + [2] * 4, [1] * 10])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    rule = MaskRule(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg),
                    causal=True)

    @jax.jit
    def run(key, noise):  # the layer's own init, moved as make moves a model's; its output
        p = jax.tree.map(lambda w, n: w * 3.0 + 0.1 * n,
                         nn.unbox(layer.init(key, x, jnp.asarray(pos), rule)["params"]), noise)
        return p, layer.apply({"params": p}, x, jnp.asarray(pos), rule)

    shapes = nn.unbox(jax.eval_shape(layer.init, jax.random.key(0), x, jnp.asarray(pos),
                                     rule)["params"])
    p, got = run(jax.random.key(int(rng.integers(1 << 30))),
                 jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes))
    allowed = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, :, None] == seg[:, None, :])
    want = np_mla(cfg, p, x.astype(np.float64), pos, allowed)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_absorbed_decode_scales_by_the_query_key_width_not_the_latents():
    """With a latent wider than a head's query/key (kv_lora_rank 20 against nope + rope =
    6 + 4), one MLA layer's cached steps (a chunk, then one token, both in the absorbed
    form over the latent cache) and its expanded form give the float64 definition's
    output, logits scaled by 1 / sqrt(nope + rope)."""
    import flax.linen as nn

    from jaxformer.attention.kv_cache import EMPTY_SLOT
    from jaxformer.attention.masks import MaskRule
    from jaxformer.model.latent_attention import MLAttention
    wide = dict(q_lora_rank=16, kv_lora_rank=20, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=8)
    cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, position="rope",
                      norm="rmsnorm", use_bias=False, max_seq_len=64, mla=wide)
    m, t = cfg.mla, 9
    assert m.kv_lora_rank not in (m.qk_head_dim, m.qk_head_dim - m.qk_rope_head_dim)
    assert t < mla_attention.EXPANDED_PREFILL  # the chunk runs absorbed, as a step does
    layer = MLAttention(cfg, impl="reference")
    x = rng.standard_normal((2, t, cfg.d_model)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t), (2, t)).astype(np.int32)
    shapes = nn.unbox(jax.eval_shape(lambda: layer.init(
        jax.random.key(0), x, jnp.asarray(pos), MaskRule(pos, pos))["params"]))
    p = jax.tree_util.tree_map_with_path(  # fresh weights; the norms' scales in [0.5, 3]
        lambda path, s: jnp.asarray(rng.uniform(0.5, 3, s.shape) if "scale" in str(path)
                                    else rng.normal(0, 0.15, s.shape), jnp.float32), shapes)

    @jax.jit
    def run(p, x):
        expanded = layer.apply({"params": p}, x, jnp.asarray(pos), MaskRule(pos, pos))
        cache = {"k": jnp.zeros((2, t, m.qk_rope_head_dim)),
                 "v": jnp.zeros((2, t, m.kv_lora_rank))}
        slots = jnp.broadcast_to(jnp.where(jnp.arange(t) < t - 1, jnp.arange(t), EMPTY_SLOT),
                                 (2, t))  # the last slot still empty
        first, cache = layer.apply({"params": p}, x[:, :-1], pos[:, :-1],
                                   MaskRule(pos[:, :-1], slots), cache=cache, cache_index=0)
        last, _ = layer.apply({"params": p}, x[:, -1:], pos[:, -1:], MaskRule(pos[:, -1:], pos),
                              cache=cache, cache_index=t - 1)
        return expanded, jnp.concatenate([first, last], axis=1)

    expanded, cached = run(p, x)
    want = np_mla(cfg, p, x.astype(np.float64), pos, pos[:, None, :] <= pos[:, :, None])
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(expanded), want, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(np.asarray(cached), want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("impl, scan, remat", [("chunked", False, "none"),
                                               ("blockwise", True, "full"),
                                               ("blockwise", True, "dots")])
def test_backends_and_remat_equal_the_reference(impl, scan, remat, monkeypatch):
    """Logits and every param's gradient on a packed, padded batch with a window: chunked,
    and blockwise (small blocks) scanned under remat full and dots, against the reference
    backend unscanned."""
    from jaxformer.attention import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_Q", 4)
    monkeypatch.setattr(blockwise, "BLOCK_K", 4)
    cfg, params = make(sliding_window=5)
    t = 14
    tokens = rng.integers(0, cfg.vocab_size, (2, t)).astype(np.int32)
    seg = np.stack([np.where(np.arange(t) < 8, 1, 2), np.where(np.arange(t) < 11, 1, 0)])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    w = rng.standard_normal((2, t, cfg.vocab_size)).astype(np.float32) * (seg > 0)[..., None]

    def grads(c, p):
        def loss(p):
            logits = Transformer(c).apply({"params": p}, tokens, positions=pos, segment_ids=seg)
            return jnp.sum(w * logits), logits
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(p)

    (_, want), want_g = grads(cfg.replace(attention_impl="reference"), params)
    run = cfg.replace(attention_impl=impl, scan_layers=scan, remat=remat)
    (_, got), got_g = grads(run, stack_layers(params, cfg.n_layers) if scan else params)
    real = seg > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-4,
                               atol=1e-4)
    if scan:
        want_g = stack_layers(want_g, cfg.n_layers)
    for path, g in jax.tree_util.tree_leaves_with_path(got_g):
        ref = functools.reduce(lambda x, k: x[k.key], path, want_g)
        # float32 sums in another order: an absolute slack at the leaf's own scale (leaves
        # reach ~100 here; a near-zero entry beside them moved 1.3e-4 at seed 841214719)
        scale = float(np.abs(np.asarray(ref)).max())
        np.testing.assert_allclose(g, ref, rtol=1e-3, atol=2e-6 * scale, err_msg=str(path))


@pytest.mark.parametrize("scan, q_lora, window, position, expanded", [
    (False, 16, None, "rope", True), (True, 0, None, "rope", False),
    (False, 0, 4, "rope", True), (False, 16, None, "alibi", False)])
def test_absorbed_decode_equals_the_expanded_forward(scan, q_lora, window, position, expanded,
                                                     monkeypatch):
    """A prefill and single-token steps through the latent cache (the absorbed form) give
    the full forward's logits (the expanded form) at every position: with a low-rank query
    or a full one, scanned, with a windowed layer's ring, and with a bias scheme; the
    prefill in the absorbed form, or (expanded) over the cache's latents expanded."""
    monkeypatch.setattr(mla_attention, "EXPANDED_PREFILL", 2 if expanded else 1 << 30)
    cfg, params = make(dict(MLA, q_lora_rank=q_lora), scan_layers=scan, sliding_window=window,
                       position=position)
    model = Transformer(cfg)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    split = int(rng.integers(2, 10))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))

    @jax.jit
    def run(params):
        apply = functools.partial(model.apply, {"params": params})
        cache = init_cache(cfg, 2, 20, windowed=window is not None, spare=split)
        logits, cache = apply(tokens[:, :split], pos[:, :split], cache=cache)

        def step(cache, xs):
            out, cache = apply(xs[0][:, None], xs[1][:, None], cache=cache)
            return cache, out[:, 0]
        _, steps = jax.lax.scan(step, cache, (tokens[:, split:].T, pos[:, split:].T))
        return apply(tokens), jnp.concatenate([logits, steps.transpose(1, 0, 2)], axis=1)

    full, got = (np.asarray(x) for x in run(params))
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * float(np.abs(full).max()))


def test_cache_holds_the_latent_and_the_rope_key():
    """Each layer caches kv_lora_rank + qk_rope_head_dim numbers per token (no per-head K/V);
    kv_cache_bytes counts them; greedy generate runs on it."""
    cfg, params = make()
    m = cfg.mla
    cache = init_cache(cfg, 3, 20)
    for layer in cache["layers"].values():
        assert layer["k"].shape == (3, 20, m.qk_rope_head_dim)
        assert layer["v"].shape == (3, 20, m.kv_lora_rank)
    assert kv_cache_bytes(cfg, 3, 20) == 3 * 20 * cfg.n_layers * (m.kv_lora_rank +
                                                                  m.qk_rope_head_dim) * 4
    assert kv_cache_bytes(cfg.replace(mla={}, head_dim=None), 3, 20) > kv_cache_bytes(cfg, 3, 20)
    out = generate(Transformer(cfg), params, rng.integers(1, 48, (3, 5)), max_new_tokens=3,
                   rng=jax.random.key(0), temperature=0)
    assert out.tokens.shape == (3, 3)


@pytest.mark.parametrize("change, words", [
    (dict(head_dim=16), ["model.head_dim=16", "8 + 4 = 12"]),
    (dict(n_kv_heads=2), ["model.n_kv_heads=2", "MLA"]),
    (dict(attention_impl="xla"), ["attention_impl='xla'", "values as wide", "chunked"]),
    (dict(attention_impl="splash"), ["attention_impl='splash'", "values as wide"]),
    (dict(mla=dict(MLA, qk_rope_head_dim=5)), ["qk_rope_head_dim=5", "odd"]),
    (dict(mla=dict(MLA, v_head_dim=0)), ["v_head_dim=0"]),
    (dict(position="cope"), ["position='cope'", "latents"]),
    (dict(qk_norm="head"), ["qk_norm='head'"]),
    (dict(attn_output_gate=True), ["attn_output_gate=True", "MLA"]),
    (dict(lora=dict(rank=2, targets=["query"])), ["query", "MLA"]),
])
def test_bad_mla_configs_are_one_line(change, words):
    base = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, position="rope", mla=MLA)
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**base, **change})
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_beam_speculative_and_int8_run_on_the_latent_cache():
    """Beam search of width 1 is greedy decoding, a draft model proposing for itself
    accepts every token and decodes greedy's tokens, and int8 weights decode the tokens of
    their dequantized float32 values (not float greedy's: a sharp random model's int8
    rounding can change its first token, after which no later one need agree), all over
    the latent cache (one cache row per batch row)."""
    from jaxformer.decode import beam_search
    from jaxformer.model.quantize import dequantize, quantize
    cfg, params = make(n_layers=1)  # one layer's latent cache: each program half the size
    model = Transformer(cfg)
    prompts = rng.integers(1, cfg.vocab_size, (2, 6)).astype(np.int32)
    greedy = np.asarray(generate(model, params, prompts, max_new_tokens=5,
                                 rng=jax.random.key(0), temperature=0).tokens)
    beam = beam_search(model, params, prompts, beam_width=1, max_new_tokens=5)
    np.testing.assert_array_equal(np.asarray(beam.tokens), greedy)
    spec = generate(model, params, prompts, max_new_tokens=5, rng=jax.random.key(0),
                    temperature=0, draft=(model, params), draft_len=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), greedy)
    assert int(np.sum(spec.accepted)) == int(np.sum(spec.drafted)) > 0
    int8 = quantize(params, "int8")  # decodes as its own values in float32 would
    tokens = generate(model, int8, prompts, max_new_tokens=5, rng=jax.random.key(0),
                      temperature=0).tokens
    want = generate(model, dequantize(int8), prompts, max_new_tokens=5,
                    rng=jax.random.key(0), temperature=0).tokens
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))


def test_hooks_name_the_latents_and_the_cache_holds_them():
    """run_with_cache has TransformerLens 4's MLA names with their shapes, and what a
    prefill writes to the KV cache is exactly the hooked latent and rotated key."""
    from jaxformer.model.inspect import run_with_cache
    cfg, params = make()
    m = cfg.mla
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)), jnp.int32)

    @jax.jit
    def run(params, tokens):  # the hooked forward and a prefill into the cache
        _, acts = run_with_cache(Transformer(cfg), params, tokens)
        _, cache = Transformer(cfg).apply({"params": params}, tokens,
                                          cache=init_cache(cfg, 2, 10))
        return acts, cache

    acts, cache = run(params, tokens)
    shapes = {n: acts[f"blocks.0.attn.{n}"].shape for n in
              ("hook_q_latent", "hook_kv_latent", "hook_rot_q", "hook_rot_k", "hook_q", "hook_v")}
    assert shapes == {"hook_q_latent": (2, 7, m.q_lora_rank),
                      "hook_kv_latent": (2, 7, m.kv_lora_rank),
                      "hook_rot_q": (2, 7, cfg.n_heads, m.qk_rope_head_dim),
                      "hook_rot_k": (2, 7, 1, m.qk_rope_head_dim),
                      "hook_q": (2, 7, cfg.n_heads, m.qk_head_dim),
                      "hook_v": (2, 7, cfg.n_heads, m.v_head_dim)}
    for i in range(cfg.n_layers):
        layer = cache["layers"][f"block_{i}"]
        np.testing.assert_allclose(np.asarray(layer["v"][:, :7]),
                                   np.asarray(acts[f"blocks.{i}.attn.hook_kv_latent"]), rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(layer["k"][:, :7]),
                                   np.asarray(acts[f"blocks.{i}.attn.hook_rot_k"])[:, :, 0],
                                   rtol=1e-4, atol=1e-5)


def test_mla_hooks_match_transformer_lens(tmp_path):
    """A random DeepSeek-V3 (MLA with a low-rank query, interleaved rotary weights, a dense
    first layer, routed and shared experts) read by from_hf and booted offline by
    TransformerLens 4's TransformerBridge from the same folder: every MLA hook TransformerLens
    has (the latents, the rotated slices, the expanded q, k, v) and the logits are its own.
    It lays the expanded q, k, v out as [B, N, T, .]; ours [B, T, N, .]."""
    pytest.importorskip("transformer_lens.model_bridge")
    import torch
    import transformers

    from jaxformer.convert import from_hf
    from jaxformer.model.inspect import run_with_cache
    from tests.hf.test_families import random_hf_model, transformer_lens_bridge
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, kv_lora_rank=12, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=1,
        n_group=2, topk_group=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    random_hf_model(config, int(rng.integers(1 << 31))).save_pretrained(tmp_path)
    bridge = transformer_lens_bridge(tmp_path, 64)
    tokens = rng.integers(0, 64, (2, 9))
    their_logits, theirs = bridge.run_with_cache(torch.tensor(tokens))
    cfg, params = from_hf(tmp_path)
    hooks = ("hook_q_latent", "hook_kv_latent", "hook_rot_q", "hook_rot_k", "hook_q", "hook_k",
             "hook_v")
    names = [f"blocks.{i}.attn.{h}" for i in range(2) for h in hooks]
    logits, ours = jax.jit(lambda p, t: run_with_cache(Transformer(cfg), p, t, names=names))(
        params, jnp.asarray(tokens))
    for name in names:
        want = theirs[name].detach().numpy()
        got = np.asarray(ours[name])
        if name.endswith(("hook_q", "hook_k", "hook_v")):  # theirs [B, N, T, .]
            got = got.transpose(0, 2, 1, 3)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(logits), their_logits.detach().numpy(), rtol=1e-4,
                               atol=1e-5)
