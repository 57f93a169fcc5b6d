"""The KV-cached decoder against full forwards, samplers against their distributions,
beam search against exhaustive search. Fresh random weights and prompts every run."""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxformer
from jaxformer import ModelConfig, Transformer
from jaxformer.decoding import (beam_search, filter_logits, generate, init_cache, kv_cache_bytes,
                                sample_logits)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
SCHEMES = ["rope", "alibi", "sinusoidal", "learned", "none"]
# (n_kv_heads, scan_layers, block): an orthogonal array, so every pair of settings meets
# every position scheme (5 x 4 cases instead of the full 5 x 8)
COMBOS = [(4, False, "pre_ln"), (4, True, "post_ln"), (2, False, "post_ln"), (2, True, "pre_ln")]


def make(position="rope", n_kv_heads=4, scan=False, block="pre_ln", **kw):
    cfg = ModelConfig(**{**dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4,
                                n_kv_heads=n_kv_heads, max_seq_len=48, position=position,
                                scan_layers=scan, block=block), **kw})
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        jnp.zeros((1, 4), jnp.int32))["params"]
    # sharper, varied distributions than init's near-uniform ones
    params = jax.tree.map(lambda x: x * 3.0, params)
    return model, params


def ragged_prompts(batch, width, vocab):
    lengths = rng.integers(1, width + 1, batch)
    lengths[0] = width
    prompts = rng.integers(1, vocab, (batch, width)).astype(np.int32)
    for b, n in enumerate(lengths):
        prompts[b, n:] = 0
    return prompts, lengths.astype(np.int32)


@pytest.mark.parametrize("kv, scan, block", COMBOS)
@pytest.mark.parametrize("position", SCHEMES)
def test_cached_logits_equal_full_forward(position, kv, scan, block):
    model, params = make(position, kv, scan, block, sliding_window=5 if kv == 2 else None)
    cfg = model.cfg
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
    full = model.apply({"params": params}, tokens)  # [B, 20, V]
    split = int(rng.integers(1, 12))
    cache = init_cache(cfg, 2, 24)
    pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
    apply = jax.jit(lambda x, p, c: model.apply({"params": params}, x, p, cache=c))
    logits, cache = apply(tokens[:, :split], pos[:, :split], cache)
    got = [logits]
    for t in range(split, 20):
        step, cache = apply(tokens[:, t:t + 1], pos[:, t:t + 1], cache)
        got.append(step)
    got = jnp.concatenate(got, axis=1)
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * float(jnp.abs(full).max()))
    # without positions, a cached call continues after the tokens already in the cache
    implicit, _ = model.apply({"params": params}, tokens[:, split:split + 1],
                              cache=apply(tokens[:, :split], pos[:, :split],
                                          init_cache(cfg, 2, 24))[1])
    np.testing.assert_allclose(implicit[:, 0], full[:, split], rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(full).max()))


def greedy_by_recompute(model, params, prompts, lengths, n):
    """Argmax rollout with a full forward per token (no cache), for every row at once: a
    fixed [B, W + n] buffer, read at each row's last real position (causal, so the slots
    after it do not matter)."""
    b, w = prompts.shape
    buf = np.zeros((b, w + n), np.int32)
    buf[:, :w] = prompts
    forward = jax.jit(lambda x: model.apply({"params": params}, x))
    for i in range(n):
        logits = np.asarray(forward(buf))
        for r in range(b):
            buf[r, lengths[r] + i] = int(np.argmax(logits[r, lengths[r] + i - 1]))
    return np.stack([buf[r, lengths[r]:lengths[r] + n] for r in range(b)])


@pytest.mark.parametrize("kv, scan, block", COMBOS[:2] + COMBOS[3:])
@pytest.mark.parametrize("position", SCHEMES)
def test_greedy_equals_recompute_rollout_ragged(position, kv, scan, block):
    model, params = make(position, kv, scan, block)
    prompts, lengths = ragged_prompts(3, 7, model.cfg.vocab_size)
    out = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=6,
                   rng=jax.random.key(0), temperature=0.0)
    assert out.tokens.shape == (3, 6) and out.logprobs.shape == (3, 6)
    np.testing.assert_array_equal(out.tokens, greedy_by_recompute(model, params, prompts,
                                                                  lengths, 6))
    np.testing.assert_array_equal(out.lengths, 6)


def test_each_row_of_a_ragged_batch_decodes_as_alone():
    model, params = make("rope", 2, sliding_window=4)
    prompts, lengths = ragged_prompts(3, 7, model.cfg.vocab_size)
    key = jax.random.key(int(rng.integers(1 << 30)))
    batch = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=6,
                     rng=key, temperature=0.0)
    for b in range(3):
        alone = generate(model, params, prompts[b:b + 1], prompt_lengths=lengths[b:b + 1],
                         max_new_tokens=6, rng=key, temperature=0.0)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])
        np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[b], rtol=1e-5, atol=1e-6)


def test_logprobs_are_the_models():
    model, params = make("alibi", 2)
    prompts, lengths = ragged_prompts(2, 5, model.cfg.vocab_size)
    out = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=4,
                   rng=jax.random.key(int(rng.integers(1 << 30))), temperature=1.3)
    for b in range(2):
        seq = list(prompts[b, :lengths[b]]) + out.tokens[b].tolist()
        logp = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray([seq]))[0])
        n = lengths[b]
        want = [float(logp[n - 1 + i, out.tokens[b, i]]) for i in range(4)]
        np.testing.assert_allclose(out.logprobs[b], want, rtol=1e-4, atol=1e-5)


def test_top_k_1_is_greedy_and_rng_reproducible():
    model, params = make("rope", 2)
    prompts, lengths = ragged_prompts(4, 6, model.cfg.vocab_size)
    kw = dict(prompt_lengths=lengths, max_new_tokens=8)
    greedy = generate(model, params, prompts, rng=jax.random.key(1), temperature=0.0, **kw)
    top1 = generate(model, params, prompts, rng=jax.random.key(2), temperature=1.0, top_k=1, **kw)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    a = generate(model, params, prompts, rng=jax.random.key(7), temperature=1.0, **kw)
    b = generate(model, params, prompts, rng=jax.random.key(7), temperature=1.0, **kw)
    c = generate(model, params, prompts, rng=jax.random.key(8), temperature=1.0, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


def np_distribution(logits, temperature, top_k, top_p):
    """float64 reference of what sampling should draw from."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-p)
        keep = np.zeros_like(p, bool)
        total = 0.0
        for i in order:  # the smallest set whose mass reaches top_p
            keep[i] = True
            total += p[i]
            if total >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None), (0.5, None, None), (2.0, None, None), (1.0, 4, None),
    (1.0, None, 0.7), (0.7, 5, 0.8)])
def test_sampled_frequencies_match_distribution(temperature, top_k, top_p):
    logits = rng.normal(size=8).astype(np.float32) * 1.5
    n = 40_000
    draws = sample_logits(jax.random.key(int(rng.integers(1 << 30))),
                          jnp.broadcast_to(jnp.asarray(logits), (n, 8)),
                          temperature=temperature, top_k=top_k, top_p=top_p)
    counts = np.bincount(np.asarray(draws), minlength=8)
    p = np_distribution(logits, temperature, top_k, top_p)
    assert counts[p == 0].sum() == 0  # nothing outside the kept set
    kept = p > 0
    if kept.sum() > 1:  # (one kept token: the assertion above already says it all)
        chi2, pvalue = stats.chisquare(counts[kept], n * p[kept])
        assert pvalue > 1e-6, (counts, n * p)
    np.testing.assert_allclose(
        np.exp(np.asarray(filter_logits(jnp.asarray(logits), temperature=temperature,
                                        top_k=top_k, top_p=top_p), np.float64))
        / np.exp(np.asarray(filter_logits(jnp.asarray(logits), temperature=temperature,
                                          top_k=top_k, top_p=top_p), np.float64)).sum(),
        p, rtol=1e-5, atol=1e-7)


def test_eos_stops_a_row():
    model, params = make("rope", 4)
    prompts, lengths = ragged_prompts(4, 5, model.cfg.vocab_size)
    free = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=10,
                    rng=jax.random.key(3), temperature=0.0)
    eos = int(free.tokens[0, 3])  # row 0 emits it at step 3 (or earlier)
    out = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=10,
                   rng=jax.random.key(3), temperature=0.0, eos_id=eos, pad_id=36)
    for b in range(4):
        row = np.asarray(free.tokens[b])
        hits = np.flatnonzero(row == eos)
        n = hits[0] + 1 if hits.size else 10
        assert int(out.lengths[b]) == n
        np.testing.assert_array_equal(out.tokens[b, :n], row[:n])
        assert (np.asarray(out.tokens[b, n:]) == 36).all()
        assert (np.asarray(out.logprobs[b, n:]) == 0).all()


def test_prompt_beyond_max_seq_len_is_an_error():
    model, params = make("learned")
    with pytest.raises(ValueError, match="prompt width 40 \\+ max_new_tokens 9 = 49 exceeds "
                                         "max_seq_len=48"):
        generate(model, params, np.ones((1, 40), np.int32), max_new_tokens=9,
                 rng=jax.random.key(0))
    with pytest.raises(ValueError, match="token ids must be in \\[0, 37\\)"):
        generate(model, params, jnp.full((1, 4), 37, jnp.int32), max_new_tokens=2,
                 rng=jax.random.key(0))
    for bad in ([0], [5]):
        with pytest.raises(ValueError, match="prompt_lengths must be 1 values in \\[1, 4\\]"):
            beam_search(model, params, jnp.ones((1, 4), jnp.int32), prompt_lengths=bad,
                        beam_width=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="width >= 1"):
        generate(model, params, [[]], max_new_tokens=2, rng=jax.random.key(0))
    out = generate(model, params, [[1, 2, 3]], max_new_tokens=2, rng=jax.random.key(0))
    assert out.tokens.shape == (1, 2)  # a plain list is a prompt too


def test_jit_and_vmap_over_prompts():
    model, params = make("alibi", 2, scan=True)
    prompts = rng.integers(0, 37, (3, 2, 5)).astype(np.int32)  # 3 groups of 2 prompts
    fn = lambda p: generate(model, params, p, max_new_tokens=4, rng=jax.random.key(0),  # noqa
                            temperature=0.0).tokens
    batched = jax.jit(jax.vmap(fn))(prompts)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], fn(prompts[i]))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's compiled loop")
@pytest.mark.parametrize("scan", [False, True])
def test_decode_loop_updates_cache_in_place(scan):
    """In the compiled decode loop each layer's K and V are only updated in place: no copy
    or transpose of a cache-sized array (a [B, K, S, H] cache at batch 1 was copied four
    times per layer per step, and scanned layers sliced it out of the stacked cache)."""
    model, params = make(n_kv_heads=2, scan=scan)
    run = jax.jit(lambda params, prompts: generate(model, params, prompts, max_new_tokens=8,
                                                   rng=jax.random.key(0), temperature=0.0))
    hlo = run.lower(params, jnp.zeros((1, 4), jnp.int32)).compile().as_text()
    name = re.search(r"while\(.*body=(%[\w.\-]+)", hlo).group(1)
    start = hlo.index(f"\n{name} ")
    body = hlo[start:hlo.index("\n}\n", start)]
    cache_size = 1 * 2 * (4 + 8) * model.cfg.head_dim  # batch * kv heads * slots * head_dim
    ops = [op for dims, op in re.findall(r"= f32\[([\d,]+)\]\S* ([\w-]+)\(", body)
           if math.prod(map(int, dims.split(","))) == cache_size]
    assert "copy" not in ops and ops.count("fusion") == 2 * model.cfg.n_layers, ops


@pytest.mark.parametrize("scan", [False, True])
def test_kv_cache_bytes_formula(scan):
    cfg = ModelConfig(vocab_size=37, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2,
                      scan_layers=scan)
    for dtype in ("float32", "bfloat16"):
        cache = init_cache(cfg, 5, 40, dtype)
        allocated = sum(x.nbytes for x in jax.tree.leaves(cache["layers"]))
        assert allocated == kv_cache_bytes(cfg, 5, 40, dtype) == \
            2 * 3 * 2 * 8 * 40 * jnp.dtype(dtype).itemsize * 5
    # the seeds' GPT-3 number: 2 * 96 * 96 * 128 * 2048 * 2 bytes ~ 9.6 GB per sequence
    assert jaxformer.kv_cache_bytes is kv_cache_bytes  # the public name
    gpt3 = ModelConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96)
    assert kv_cache_bytes(gpt3, 1, 2048, "bfloat16") == 2 * 96 * 96 * 128 * 2048 * 2
    assert round(kv_cache_bytes(gpt3, 1, 2048, "bfloat16") / 1e9, 1) == 9.7


def test_bf16_cache_close_to_float32():
    model, params = make("rope", 2)
    prompts, lengths = ragged_prompts(2, 6, model.cfg.vocab_size)
    a = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=3,
                 rng=jax.random.key(0), temperature=0.0)
    b = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=3,
                 rng=jax.random.key(0), temperature=0.0, cache_dtype="bfloat16")
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=0.1)


# ---- beam search --------------------------------------------------------------------

def sequence_logprob(model, params, prompt, continuation):
    seq = jnp.asarray([list(prompt) + list(continuation)], jnp.int32)
    logp = jax.nn.log_softmax(model.apply({"params": params}, seq)[0])
    n = len(prompt)
    return sum(float(logp[n - 1 + i, t]) for i, t in enumerate(continuation))


def test_beam_width_1_is_greedy():
    model, params = make("rope", 2, scan=True)
    prompts, lengths = ragged_prompts(3, 5, model.cfg.vocab_size)
    greedy = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=5,
                      rng=jax.random.key(0), temperature=0.0)
    beams = beam_search(model, params, prompts, prompt_lengths=lengths, beam_width=1,
                        max_new_tokens=5, length_penalty=0.0)
    np.testing.assert_array_equal(beams.tokens, greedy.tokens)
    np.testing.assert_allclose(beams.scores, np.asarray(greedy.logprobs).sum(1), rtol=1e-5)


def test_exhaustive_beam_finds_the_best_sequence_and_beats_greedy():
    """With beam_width = V^(n-1) nothing is ever pruned: the result is the argmax over all
    V^n continuations, which brute force confirms; it scores at least greedy's."""
    model, params = make("alibi", 2, vocab_size=5)
    prompt = rng.integers(0, 5, (1, 4)).astype(np.int32)
    n = 3
    beams = beam_search(model, params, prompt, beam_width=25, max_new_tokens=n,
                        length_penalty=0.0)
    conts = np.asarray(list(itertools.product(range(5), repeat=n)), np.int32)  # [125, n]
    seqs = np.concatenate([np.repeat(prompt, len(conts), 0), conts], axis=1)
    logp = np.asarray(jax.nn.log_softmax(model.apply({"params": params}, seqs)), np.float64)
    steps = np.arange(n)
    totals = logp[:, prompt.shape[1] - 1 + steps][np.arange(len(conts))[:, None], steps, conts]
    scores = {tuple(c): float(s) for c, s in zip(conts.tolist(), totals.sum(1))}
    best = max(scores, key=scores.get)
    assert tuple(beams.tokens[0].tolist()) == best
    assert float(beams.scores[0]) == pytest.approx(scores[best], abs=1e-4)
    greedy = generate(model, params, prompt, max_new_tokens=n, rng=jax.random.key(0),
                      temperature=0.0)
    assert float(beams.scores[0]) >= float(greedy.logprobs.sum()) - 1e-5


def test_beam_eos_and_length_penalty():
    model, params = make("rope", 4)
    prompt = rng.integers(1, 37, (1, 4)).astype(np.int32)
    beams = beam_search(model, params, prompt, beam_width=4, max_new_tokens=6,
                        length_penalty=1.0, eos_id=int(prompt[0, 0]), pad_id=0)
    n = int(beams.lengths[0])
    toks = beams.tokens[0].tolist()
    if n < 6:
        assert toks[n - 1] == int(prompt[0, 0]) and all(t == 0 for t in toks[n:])
    want = sequence_logprob(model, params, prompt[0], toks[:n]) / n
    assert float(beams.scores[0]) == pytest.approx(want, abs=1e-4)
