"""model.loss_chunk: the blockwise head and loss equal a float64 NumPy loss (z-loss, label
smoothing, a mask, a soft-capped head) and the model's plain loss, values and gradients;
the compiled chunked step holds no [B, T, V] buffer; bad settings are refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.core.validation import ConfigError
from jaxformer.model.transformer import Transformer
from jaxformer.training import load_config, objectives
from jaxformer.training.chunked_loss import (ChunkedLanguageModel, chunked_sums, chunked_terms,
                                             token_logps, token_losses)
from jaxformer.training.objectives.language_model import MultiTokenLM
from jaxformer.training.step import joined, loss_terms
from tests.conftest import DEFAULT_EMITTERS

CAP, SMOOTH, Z = 3.0, 0.1, 0.01


def np_loss_and_grads(x, w, targets, mask):
    """float64: sum over the mask of the smoothed cross entropy + Z lse^2 of the logits
    CAP tanh(x w / CAP), and its gradients with respect to x [B, T, D] and w [D, V]."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    raw = x @ w  # [B, T, V]
    logits = CAP * np.tanh(raw / CAP)
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]  # [B, T]
    v = logits.shape[-1]
    onehot = np.eye(v)[targets]  # [B, T, V]
    q = (1 - SMOOTH) * onehot + SMOOTH / v
    loss = lse - (q * logits).sum(-1) + Z * lse**2  # [B, T]
    p = np.exp(logits - lse[..., None])
    dlogits = (p - q + 2 * Z * lse[..., None] * p) * mask[..., None]
    draw = dlogits * (1 - np.tanh(raw / CAP) ** 2)
    return (loss * mask).sum(), draw @ w.T, np.einsum("btd,btv->dv", x, draw)


def test_chunked_sums_equal_a_float64_loss_and_gradients(rng):
    """Blocks of 4 positions over T = 11 (a padded last block): the value and the gradients
    of x and the head's weight equal the float64 ones within float32 rounding."""
    b, t, d, v = 2, 11, 8, 37
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)

    def head(hp, h):
        return CAP * jnp.tanh(jnp.einsum("bnd,dv->bnv", h, hp) / CAP)  # [B, N, V]

    def total(x, w):
        return chunked_sums(head, w, x, targets, mask, 4, label_smoothing=SMOOTH, z_loss=Z)

    (value, count), grads = jax.jit(jax.value_and_grad(total, (0, 1), has_aux=True))(x, w)
    want, dx, dw = np_loss_and_grads(x, w, targets, mask)
    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(value), want, rtol=2e-6)
    np.testing.assert_allclose(grads[0], dx, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(grads[1], dw, rtol=1e-4, atol=2e-6)


def packed_batch(rng, b, t, v):
    """Random tokens packed as two documents a row, the second starting at a random place;
    a random loss mask, zero on the last document's padding."""
    tokens = rng.integers(0, v, (b, t + 1)).astype(np.int32)
    cut = rng.integers(2, t - 2, b)
    idx = np.arange(t)
    seg = np.where(idx < cut[:, None], 1, 2).astype(np.int32)
    seg[:, -2:] = 0  # padding
    pos = np.where(seg == 1, idx, idx - cut[:, None]).astype(np.int32)
    mask = ((rng.random((b, t)) < 0.8) & (seg > 0)).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask,
            "segment_ids": seg, "positions": pos}


def test_the_model_chunked_loss_equals_its_plain_loss(rng):
    """model.loss_chunk=5 read from the config (under model.) picks the chunked hooks; on a
    packed batch with a mask, an untied head with bias, multiplier and soft-cap, the summed
    loss and every parameter's gradient equal the plain loss's (training.step.loss_terms)."""
    cfg = load_config(None, ["model.vocab_size=97", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2", "model.norm=rmsnorm", "model.final_softcap=4.0",
                             "model.logits_multiplier=0.7", "model.tie_embeddings=false",
                             "model.head_bias=true", "model.loss_chunk=5"])
    assert objectives.build(cfg) == ChunkedLanguageModel(1, 5)
    batch = packed_batch(rng, 2, 13, 97)
    model = Transformer(cfg.model)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    params = jax.jit(model.init)(key, batch["inputs"])["params"]
    params["head_bias"] = jnp.asarray(rng.normal(size=97), jnp.float32)  # not its zeros
    plain = jax.jit(jax.value_and_grad(lambda p: loss_terms(model, p, batch)[0]))(params)
    chunked = jax.jit(jax.value_and_grad(lambda p: chunked_terms(model, p, batch, 5)[0]))(
        params)
    np.testing.assert_allclose(float(chunked[0]), float(plain[0]), rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(chunked[1]),
                            jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))


def largest_buffer(fn, *args) -> int:
    """The most elements of any float32 array in fn's compiled (optimised) HLO."""
    text = jax.jit(fn).lower(*args).compile(DEFAULT_EMITTERS).as_text()
    return max(int(np.prod([int(s) for s in dims.split(",")])) if dims else 1
               for dims in re.findall(r"f32\[([\d,]*)\]", text))


def test_the_chunked_step_holds_no_full_logits(rng):
    """The compiled gradient of the model's chunked loss (blocks of 16 of T = 64) has no
    float32 array of B x T x V elements or more; a plain head's loss has (the check sees
    them)."""
    b, t, v = 2, 64, 512
    cfg = load_config(None, ["model.vocab_size=512", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2", f"model.max_seq_len={t}"]).model
    model = Transformer(cfg)
    tokens = rng.integers(0, v, (b, t + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((b, t), np.float32)}
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch["inputs"]))["params"]
    chunked = largest_buffer(jax.grad(lambda p: chunked_terms(model, p, batch, 16)[0]), params)
    logps = largest_buffer(jax.grad(lambda p: jnp.sum(token_logps(  # grpo's log-probs
        model, p, tokens[:, :-1], chunk=16))), params)
    w = jax.ShapeDtypeStruct((cfg.d_model, v), jnp.float32)  # the check sees a plain head's
    x = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)
    plain = largest_buffer(jax.grad(lambda w: jnp.sum(token_losses(x @ w, batch["targets"]))), w)
    assert plain >= b * t * v
    assert chunked < b * t * v // 2 and logps < b * t * v // 2, (chunked, logps)


def test_the_mtp_chunked_loss_equals_the_plain_one_without_full_logits(rng):
    """Multi-token prediction (2 depths, a packed batch) with model.loss_chunk=16: the train
    loss, each depth's loss and every gradient equal the plain loss's (tests/model/test_mtp.py
    holds both against float64), and the compiled chunked gradient has no float32 array of
    B x T x V elements or more, of any depth (a plain head's has: the test above)."""
    from tests.model.test_mtp import CFG, random_params
    b, t = 2, 64
    cfg = CFG.replace(vocab_size=512, max_seq_len=t)
    params, model = random_params(cfg, int(rng.integers(1 << 20))), Transformer(cfg)
    batch = packed_batch(rng, b, t, cfg.vocab_size)

    def loss(chunk):
        return lambda p: MultiTokenLM(weight=0.3, chunk=chunk).train_loss(model, p, batch)
    (plain, aux), grads = jax.jit(jax.value_and_grad(loss(0), has_aux=True))(params)
    (chunked, chunked_aux), chunked_grads = jax.jit(jax.value_and_grad(loss(16),
                                                                       has_aux=True))(params)
    np.testing.assert_allclose(float(chunked), float(plain), rtol=2e-6)
    np.testing.assert_allclose(chunked_aux[2]["mtp_sum"], aux[2]["mtp_sum"], rtol=2e-6)
    top = max(np.abs(g).max() for g in jax.tree.leaves(grads))  # float32 sums of another
    for (path, a), g in zip(jax.tree_util.tree_leaves_with_path(chunked_grads),  # order
                            jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, g, rtol=1e-4, atol=2e-6 * top, err_msg=str(path))
    held = largest_buffer(jax.grad(lambda p: loss(16)(p)[0]), params)
    assert held < b * t * cfg.vocab_size // 2, held


def test_a_lora_sweeps_chunked_losses_equal_the_plain_ones(rng):
    """A LoRA sweep (ranks 1 and 2, random adapters) with model.loss_chunk=8: each member's
    summed loss and every member's adapter gradients (one vmapped step) equal the plain
    loss's, the eval step's too, and the compiled chunked gradient holds no array of half
    the members' logits (2 x B x T x V; its blocks are 2 x B x 8 x V, its largest array
    the members' FFN activations)."""
    from jaxformer.training.step import LanguageModel, trained_part
    from jaxformer.training.sweep import sweep_params
    b, t, v = 2, 64, 512
    cfg = load_config(None, [f"model.vocab_size={v}", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2", f"model.max_seq_len={t}",
                             "model.lora.sweep_rank=1,2", "model.loss_chunk=8"])
    assert objectives.build(cfg) == ChunkedLanguageModel(1, 8)
    batch = packed_batch(rng, b, t, v)
    model = Transformer(cfg.model)
    params = sweep_params(model, jax.random.key(int(rng.integers(1 << 30))), batch["inputs"])
    params = jax.tree_util.tree_map_with_path(lambda p, x: jnp.asarray(
        rng.normal(0, 0.3, x.shape), x.dtype) if "lora_b" in str(p) else x, params)
    trained, frozen = trained_part(params)

    def sums(hooks):
        return jax.jit(lambda t: (hooks.gradient_sums(model, t, frozen, batch, None)[:3],
                                  hooks.eval_sums(model, joined(t, frozen), batch)))(trained)
    ((total, count, grads), evaluated), ((want, want_count, want_grads), want_eval) = (
        sums(ChunkedLanguageModel(1, 8)), sums(LanguageModel(1)))
    assert total.shape == (2,) and float(count) == float(want_count)
    np.testing.assert_allclose(total, want, rtol=2e-6)
    np.testing.assert_allclose(evaluated[0], want_eval[0], rtol=2e-6)
    top = max(np.abs(w).max() for w in jax.tree.leaves(want_grads))  # float32 sums of
    for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(grads),  # another order
                            jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=2e-6 * top, err_msg=str(path))
    held = largest_buffer(lambda t: ChunkedLanguageModel(1, 8).gradient_sums(
        model, t, frozen, batch, None)[2], trained)
    assert held < 2 * b * t * v // 2, held  # two members' logits: 2 x B x T x V


def test_the_encoder_decoder_chunked_loss_equals_its_plain_loss(rng):
    """model.loss_chunk=16 with model.arch=encoder_decoder and optim.label_smoothing=0.1
    (the config picks Seq2Seq's chunked hooks): on packed pairs (two a row, padding) with an
    untied soft-capped head with bias, the summed cross entropy, the smoothed loss's
    gradient of every parameter (the encoder's too) and the eval sums equal the plain
    loss's, and the compiled chunked gradient holds no float32 array of B x T x V."""
    from jaxformer.model.build import model_for
    b, s, t, v = 2, 24, 64, 512
    cfg = load_config(None, ["model.arch=encoder_decoder", f"model.vocab_size={v}",
                             "model.d_model=32", "model.n_layers=1", "model.encoder_layers=1",
                             "model.n_heads=2", f"model.max_seq_len={t}",
                             "model.tie_embeddings=false", "model.head_bias=true",
                             "model.final_softcap=4.0", "optim.label_smoothing=0.1",
                             "data.format=seq2seq", "data.path=x.jsonl",
                             "model.loss_chunk=16"])
    hooks = objectives.build(cfg)
    assert (hooks.chunk, hooks.smoothing) == (16, 0.1)
    batch = packed_batch(rng, b, t, v)
    cut = rng.integers(2, s - 2, b)[:, None]
    idx = np.arange(s)
    batch.update(sources=rng.integers(0, v, (b, s)).astype(np.int32),
                 source_segment_ids=np.where(idx < cut, 1, 2).astype(np.int32),
                 source_positions=np.where(idx < cut, idx, idx - cut).astype(np.int32))
    model = model_for(cfg.model)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    params = jax.jit(model.init)(key, batch["sources"], batch["inputs"])["params"]
    params["decoder"]["head_bias"] = jnp.asarray(rng.normal(size=v), jnp.float32)
    plain = type(hooks)(0.1)

    def sums(h):
        return jax.jit(lambda p: (h.gradient_sums(model, p, {}, batch, None)[:3],
                                  h.eval_sums(model, p, batch)[:2]))(params)
    ((nll, count, grads), evaluated), ((want, want_count, want_grads), want_eval) = (
        sums(hooks), sums(plain))
    assert float(count) == float(want_count) == batch["loss_mask"].sum()
    np.testing.assert_allclose(float(nll), float(want), rtol=2e-6)
    np.testing.assert_allclose(evaluated, want_eval, rtol=2e-6)
    assert float(nll) != pytest.approx(float(hooks.sums(model, params, batch)[0]))  # smoothed
    top = max(np.abs(w).max() for w in jax.tree.leaves(want_grads))  # float32 sums of
    for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(grads),  # another order
                            jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=2e-6 * top, err_msg=str(path))
    held = largest_buffer(lambda p: hooks.gradient_sums(model, p, {}, batch, None)[2], params)
    assert held < b * t * v // 2, held


def test_a_negative_loss_chunk_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.loss_chunk=-1"])
    assert "model.loss_chunk=-1" in str(err.value) and "\n" not in str(err.value)
