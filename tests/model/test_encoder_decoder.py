"""The encoder-decoder (model.arch=encoder_decoder: jaxformer.model.encoder_decoder, its
decoder's jaxformer.model.cross_attention): one encoder layer and one decoder layer against a float64 NumPy definition on a padded batch, packing both sides, and what
a target position's logits depend on (causal in the target, its own segment of the
source)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.core.hooks import session
from jaxformer.core.validation import ConfigError
from jaxformer.decode.seq2seq import seq2seq_generate
from jaxformer.model.build import param_shapes
from jaxformer.model.config import ModelConfig
from jaxformer.model.encoder_decoder import EncoderDecoder
from jaxformer.model.layer_runs import stack_layers, unstack_layers

V, D, N = 13, 16, 2


def config(**overrides):
    return ModelConfig(**{**dict(arch="encoder_decoder", vocab_size=V, d_model=D, n_heads=N,
                                 n_layers=1, encoder_layers=1, max_seq_len=32, position="none",
                                 attention_impl="reference"), **overrides})


def random_params(cfg, rng, std=0.3):
    """A fresh model's params redrawn N(0, std) (norm scales around 1), float32."""
    model = EncoderDecoder(cfg)
    shapes = model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                        jnp.zeros((1, 2), jnp.int32))["params"]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray((1.0 if path[-1].key == "scale" else 0.0)
                                   + rng.normal(0, std, x.shape), np.float32), shapes)


# ---- the float64 definition ---------------------------------------------------------

def layernorm(x, p):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["scale"] + p["bias"]


def attention(p, xq, xk, mask):
    """Multi-head attention, mask [B, Tq, Tk]; a query with no key gives zeros."""
    q = np.einsum("btd,dnh->btnh", xq, p["query"]["kernel"]) + p["query"]["bias"]
    k = np.einsum("bsd,dnh->bsnh", xk, p["key"]["kernel"]) + p["key"]["bias"]
    v = np.einsum("bsd,dnh->bsnh", xk, p["value"]["kernel"]) + p["value"]["bias"]
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    w = np.exp(s - np.max(np.where(mask[:, None], s, -1e300), -1, keepdims=True))
    w = np.where(mask[:, None], w, 0.0)
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
    z = np.einsum("bnts,bsnh->btnh", w, v)
    return np.einsum("btnh,nhd->btd", z, p["out"]["kernel"]) + p["out"]["bias"]


def ffn(p, x):
    h = x @ p["wi"]["kernel"] + p["wi"]["bias"]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    return h @ p["wo"]["kernel"] + p["wo"]["bias"]


def reference_logits(params, src, tgt, src_seg, tgt_seg):
    """Pre-LN, no positions, tied embeddings: encoder (no causal rule), then decoder
    (causal self-attention, cross-attention, FFN), in float64."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    emb = p["embed"]["embedding"]
    same = lambda a, b: (a[:, :, None] == b[:, None, :]) & (a[:, :, None] > 0) & (b[:, None, :] > 0)  # noqa: E731
    e = p["encoder"]["block_0"]
    x = emb[src]
    x = x + attention(e["attn"], layernorm(x, e["attn_norm"]), layernorm(x, e["attn_norm"]),
                      same(src_seg, src_seg))
    x = x + ffn(e["ffn"], layernorm(x, e["ffn_norm"]))
    memory = layernorm(x, p["encoder"]["final_norm"])
    d = p["decoder"]["block_0"]
    t = tgt.shape[1]
    y = emb[tgt]
    h = layernorm(y, d["attn_norm"])
    y = y + attention(d["attn"], h, h, same(tgt_seg, tgt_seg) & np.tri(t, dtype=bool)[None])
    y = y + attention(d["cross_attn"], layernorm(y, d["cross_norm"]), memory,
                      same(tgt_seg, src_seg))
    y = y + ffn(d["ffn"], layernorm(y, d["ffn_norm"]))
    return layernorm(y, p["decoder"]["final_norm"]) @ emb.T


def padded_batch(rng, b=3, s=7, t=6):
    """Tokens and segment ids (1 then 0 for padding) of random lengths, each >= 1."""
    src_len, tgt_len = rng.integers(1, s + 1, b), rng.integers(1, t + 1, b)
    src_seg = (np.arange(s)[None] < src_len[:, None]).astype(np.int32)
    tgt_seg = (np.arange(t)[None] < tgt_len[:, None]).astype(np.int32)
    return rng.integers(0, V, (b, s)), rng.integers(0, V, (b, t)), src_seg, tgt_seg


@pytest.mark.parametrize("impl", ["reference", "xla", "blockwise"])
def test_one_layer_each_equals_the_float64_definition(impl, rng):
    cfg = config(attention_impl=impl)
    params = random_params(cfg, rng)
    src, tgt, src_seg, tgt_seg = padded_batch(rng)
    got = EncoderDecoder(cfg).apply({"params": params}, src, tgt, source_segment_ids=src_seg,
                                    target_segment_ids=tgt_seg)
    want = reference_logits(params, src, tgt, src_seg, tgt_seg)
    real = tgt_seg > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=2e-4, atol=2e-4)


def test_packed_pairs_equal_each_pair_apart(rng):
    """Two (source, target) pairs in one row, both sides packed with positions restarting
    per segment, give each pair's logits alone."""
    cfg = config(position="rope", n_layers=2)
    params = random_params(cfg, rng, std=0.2)
    model = EncoderDecoder(cfg)
    (s1, s2), (t1, t2) = rng.integers(2, 6, 2), rng.integers(2, 5, 2)
    srcs = [rng.integers(0, V, (1, n)) for n in (s1, s2)]
    tgts = [rng.integers(0, V, (1, n)) for n in (t1, t2)]
    apply = jax.jit(model.apply)  # one program per shape (eager, each op compiles per shape)
    apart = [apply({"params": params}, s, t) for s, t in zip(srcs, tgts)]
    seg = lambda a, b: np.concatenate([np.full(a, 1), np.full(b, 2), [0]])[None]  # noqa: E731
    pos = lambda a, b: np.concatenate([np.arange(a), np.arange(b), [0]])[None]  # noqa: E731
    packed = apply({"params": params}, np.concatenate([*srcs, [[0]]], 1),
                         np.concatenate([*tgts, [[0]]], 1), source_segment_ids=seg(s1, s2),
                         target_segment_ids=seg(t1, t2), source_positions=pos(s1, s2),
                         target_positions=pos(t1, t2))
    np.testing.assert_allclose(packed[0, :t1], apart[0][0], atol=2e-5)
    np.testing.assert_allclose(packed[0, t1:t1 + t2], apart[1][0], atol=2e-5)


def test_a_target_position_depends_on_its_past_and_its_whole_source_segment(rng):
    """The gradient of one target position's logits with respect to the embedded inputs
    (hooked): nonzero at every source token of its segment (after it too) and at target
    tokens up to itself in its segment; zero at later targets and at other segments."""
    cfg = config(position="rope", n_layers=2, encoder_layers=2)
    params = random_params(cfg, rng, std=0.2)
    model = EncoderDecoder(cfg)
    src_seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    tgt_seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    src, tgt = rng.integers(0, V, src_seg.shape), rng.integers(0, V, tgt_seg.shape)
    at = int(rng.integers(4, 7))  # a target position in segment 2
    w = rng.normal(size=V)

    def out(d_src, d_tgt):
        hooks = {"encoder.hook_embed": lambda x: x + d_src,
                 "decoder.hook_embed": lambda x: x + d_tgt}
        with session(hooks, lambda _: False):
            logits = model.apply({"params": params}, src, tgt, source_segment_ids=src_seg,
                                 target_segment_ids=tgt_seg)
        return logits[0, at] @ w

    g_src, g_tgt = jax.grad(out, argnums=(0, 1))(jnp.zeros((1, 8, D)), jnp.zeros((1, 8, D)))
    src_on = np.abs(np.asarray(g_src[0])).sum(-1) > 0
    tgt_on = np.abs(np.asarray(g_tgt[0])).sum(-1) > 0
    np.testing.assert_array_equal(src_on, src_seg[0] == 2)
    np.testing.assert_array_equal(tgt_on, (tgt_seg[0] == 2) & (np.arange(8) <= at))


def test_encoder_decoder_settings_it_cannot_run_are_one_line():
    for overrides, words in (({"block": "parallel"}, "model.block=parallel"),
                             ({"sliding_window": 4}, "sliding window"),
                             ({"arch": "decoder"}, "model.encoder_layers=1"),
                             ({"tie_source_embed": True}, "unties nothing with tie_embeddings"),
                             ({"arch": "decoder", "encoder_layers": None,
                               "tie_source_embed": True}, "tie_source_embed=True needs")):
        with pytest.raises(ConfigError, match=words) as e:
            config(**overrides)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.arch='seq'"):
        config(arch="seq")


# ---- scan_layers: each stack scanned ------------------------------------------------

SHAPES = {  # T5 v1.1's (relative buckets, RMSNorm, GEGLU, untied head) and BART's (post-LN)
    "t5": dict(position="t5", norm="rmsnorm", ffn="geglu", use_bias=False, qkv_bias=False,
               tie_embeddings=False, tie_source_embed=True, attn_scale=1.0),
    "bart": dict(position="learned", norm="layernorm", block="post_ln", embed_norm=True,
                 head_bias=True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_scanned_stacks_equal_the_layer_loop(shape, rng):
    """scan_layers=true on stack_layers' params (3 encoder layers, 2 decoder layers): the
    logits of a padded batch equal the per-layer model's, and the cached greedy decode (the
    cross-attention's keys and values kept in the stacked cache) gives its tokens and
    log-probs."""
    cfg = config(n_layers=2, encoder_layers=3, **SHAPES[shape])
    params = random_params(cfg, rng, std=0.3)
    scanned, stacked = EncoderDecoder(cfg.replace(scan_layers=True)), stack_layers(params, 2)
    src, tgt, src_seg, tgt_seg = padded_batch(rng)
    want = EncoderDecoder(cfg).apply({"params": params}, src, tgt, source_segment_ids=src_seg,
                                     target_segment_ids=tgt_seg)
    got = scanned.apply({"params": stacked}, src, tgt, source_segment_ids=src_seg,
                        target_segment_ids=tgt_seg)
    # float32 sums of a few dozen terms of size ~1, taken in another order; T5's unscaled
    # attention (attn_scale 1) sharpens the softmax and its rounding: over 16 draws its worst
    # logit was 2.3e-5 off (BART's 1.6e-6); a layer taken out of order is O(1)
    real = tgt_seg > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                               atol=1e-4)
    run = dict(bos_id=1, max_new_tokens=5, source_lengths=src_seg.sum(1))
    loop = seq2seq_generate(EncoderDecoder(cfg), params, src, **run)
    scan = seq2seq_generate(scanned, stacked, src, **run)
    np.testing.assert_array_equal(np.asarray(scan.tokens), np.asarray(loop.tokens))
    np.testing.assert_allclose(np.asarray(scan.logprobs), np.asarray(loop.logprobs), atol=1e-5)


def count_equations(jaxpr, primitive: str) -> int:
    """How many times `primitive` is written in a jaxpr, its inner jaxprs (a scan's body,
    once) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == primitive
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    n += count_equations(inner, primitive)
    return n


def test_scanned_forward_does_not_grow_with_depth():
    """The scanned forward's program (its jaxpr: what XLA compiles) holds one scan per stack
    and as many matmuls at 6 layers as at 2; the per-layer loop's grow 3-fold."""
    def program(layers, scan):
        cfg = config(n_layers=layers, encoder_layers=layers, scan_layers=scan,
                     **SHAPES["t5"])
        tokens = jnp.zeros((2, 5), jnp.int32)
        apply = lambda p: EncoderDecoder(cfg).apply({"params": p}, tokens, tokens)  # noqa: E731
        return jax.make_jaxpr(apply)(param_shapes(cfg)).jaxpr

    dots = {(n, scan): count_equations(program(n, scan), "dot_general")
            for n in (2, 6) for scan in (False, True)}
    assert dots[2, True] == dots[6, True] < dots[2, False] < dots[6, False] / 2.5, dots
    assert count_equations(program(6, True), "scan") == 2  # the encoder's, the decoder's


def test_stack_layers_round_trips_an_encoder_decoder(rng):
    """stack_layers puts each stack's layers on a leading axis in order (the scanned
    model's param tree: encoder 3 layers, decoder 2) and unstack_layers gives the
    per-layer params back exactly."""
    cfg = config(n_layers=2, encoder_layers=3, **SHAPES["bart"])
    params = random_params(cfg, rng)
    stacked = stack_layers(params, cfg.n_layers)
    shapes = param_shapes(cfg.replace(scan_layers=True))
    assert jax.tree.structure(stacked) == jax.tree.structure(shapes)
    assert jax.tree.all(jax.tree.map(lambda x, s: x.shape == s.shape, stacked, shapes))
    for stack, n in (("encoder", 3), ("decoder", 2)):
        for i in range(n):
            layer = jax.tree.map(lambda x, i=i: x[i], stacked[stack]["blocks"])
            assert jax.tree.all(jax.tree.map(np.array_equal, layer, params[stack][f"block_{i}"]))
    back = unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, params))
