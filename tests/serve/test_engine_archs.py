"""The serving engine (jaxformer.serve.engine over paged_cache's layout) on each kind
of decoder the library decodes, against generate alone: sliding windows (a mask over the
pages, where generate keeps a ring) with a mixture of experts, latent attention (MLA:
latent pages), a recurrent mixer beside attention (a state per slot, reset on admission
and on preemption), and every position scheme that biases the logits (their decode steps
read (row, page) pairs, the bias made from each pair's positions; ALiBi's with sinks and a
soft-cap) or computes them itself (CoPE: its steps read the page tables). Greedy requests
arriving at random steps through a pool short enough to preempt; a table of small configs,
two engine programs each (dense attention: the model of tests/serve/test_engine.py)."""

import jax
import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.decode import generate
from jaxformer.positions.schemes import schemes_of
from jaxformer.serve import Engine, RequestSettings
from tests.serve.test_engine import drive, tiny

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope")
ARCHS = {
    "window_moe": dict(layer_pattern=["l", "g"], layer_kinds={"l": {"window": 3}, "g": {}},
                       moe=dict(experts=4, top_k=2)),
    "mla": dict(mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=6), n_kv_heads=None,
                tie_embeddings=False),
    "gated_delta": dict(layer_pattern=["r", "a"],
                        layer_kinds={"r": {"mixer": "gated_delta"}, "a": {}},
                        mixer={"gated_delta": dict(heads=2, key_dim=8, value_dim=8, conv=3,
                                                   chunk=4)}),
    **{name: dict(position=name) for name in schemes_of("bias") + schemes_of("contextual")},
}
ARCHS["alibi"].update(attn_sinks=True, attn_softcap=3.0)
W, N = 8, 6  # the widest prompt, the most new tokens


@pytest.mark.parametrize("arch", list(ARCHS))
def test_each_arch_gets_generates_tokens_and_logprobs(arch):
    """Greedy requests (prompts 1-8 tokens in chunks of 4, up to 6 new) arriving at random
    steps among 4 slots and 3 pages of 8: each gets generate's tokens for it alone and its
    log-probs within 1e-5."""
    model, params = tiny(ModelConfig(**{**BASE, **ARCHS[arch]}))
    requests = random_requests(8)
    engine = Engine(model, params, slots=4, page_size=8, pages=3, prefill_chunk=4)
    out, _ = drive(engine, requests, rng.integers(0, 4, len(requests)))
    assert_generates(model, params, requests, out)
    assert engine.stats()["pages_held"] == 0 and engine.stats()["programs"] <= 2


def random_requests(n: int) -> list:
    """n greedy requests: prompts of 1..W random tokens, 1..N new tokens each."""
    return [(rng.integers(0, 64, int(rng.integers(1, W + 1))).tolist(),
             RequestSettings(max_tokens=int(rng.integers(1, N + 1)), temperature=0.0))
            for _ in range(n)]


def alone(model, params, prompt, cache_dtype=None):
    """generate's greedy N tokens for the prompt alone (padded to W: one program)."""
    padded = np.zeros((1, W), np.int32)
    padded[0, :len(prompt)] = prompt
    return generate(model, params, padded, prompt_lengths=np.array([len(prompt)]),
                    max_new_tokens=N, rng=jax.random.key(0), temperature=0.0,
                    cache_dtype=cache_dtype)


def assert_generates(model, params, requests, out, cache_dtype=None, atol=1e-5) -> list:
    """Each request's engine tokens out[k][0] are generate's alone, its log-probs out[k][1]
    generate's within atol; generate's output for each."""
    wants = [alone(model, params, prompt, cache_dtype) for prompt, _ in requests]
    for k, ((prompt, s), want) in enumerate(zip(requests, wants)):
        assert out[k][0] == np.asarray(want.tokens[0, :s.max_tokens]).tolist(), (k, prompt)
        np.testing.assert_allclose(out[k][1], want.logprobs[0, :s.max_tokens], atol=atol,
                                   rtol=0)
    return wants


@pytest.mark.parametrize("arch", ["dense", "mla"])
def test_an_int8_pool_gets_generates_int8_cache_tokens(arch):
    """Pages in int8 (a float32 scale per token and head): greedy requests get the tokens
    and log-probs of generate(..., cache_dtype="int8") alone, ten times nearer them than
    the float cache's; each entry of the pool takes (width + 4) / (4 width) of float32's
    bytes (int8 values, a float32 scale per token and head: 0.27 at width 64)."""
    model, params = tiny(ModelConfig(**{**BASE, **ARCHS.get(arch, {})}))
    requests = random_requests(8)
    engine = Engine(model, params, slots=4, page_size=8, pages=3, prefill_chunk=4,
                    cache_dtype="int8")
    out, _ = drive(engine, requests, rng.integers(0, 4, len(requests)))
    # the engine's keys and generate's differ by float rounding (chunked prefill), which
    # can move a value across an int8 rounding boundary: one code, 1.4e-4 in one suite run
    # (about 1e-6 otherwise, over 20 draws); the int8 cache's own effect is 9e-3 or more
    wants = assert_generates(model, params, requests, out, "int8", atol=1e-3)

    def furthest(generated):  # the engine's log-probs from generate's, at most
        return max(float(np.max(np.abs(np.asarray(out[k][1]) - g.logprobs[0, :s.max_tokens])))
                   for k, ((_, s), g) in enumerate(zip(requests, generated)))
    floats = [alone(model, params, p) for p, _ in requests]
    assert furthest(wants) < furthest(floats) / 10  # the int8 cache's, not the float one's
    keys = [engine.pool["layers"][n][e] for n in engine.pool["layers"] for e in ("k", "v")]
    assert all(x.values.dtype == np.int8 and x.scale.dtype == np.float32 for x in keys)
    for x in keys:  # (width + 4) / (4 width) of float32's bytes: 0.375 at width 8
        width = x.shape[-1]
        assert x.values.nbytes + x.scale.nbytes == x.values.size * (width + 4) // width


@pytest.mark.parametrize("page", [2, 8])
def test_pages_behind_every_window_are_released(page):
    """A model whose every layer has a window of 3 (pages of 2: its decode steps read the
    tables; of 8: pairs): after each step a decoding request holds at most
    ceil((3 - 1) / page) + 1 pages, the rest released as they fall behind its next token's
    window; greedy requests still get generate's tokens (its ring cache) and log-probs, and
    every page is free at the end."""
    model, params = tiny(ModelConfig(**{**BASE, "sliding_window": 3}))
    requests = random_requests(7)
    requests.append((rng.integers(0, 64, W).tolist(),  # 14 tokens: past a page of 8 + 3
                     RequestSettings(max_tokens=N, temperature=0.0)))
    engine = Engine(model, params, slots=4, page_size=page, prefill_chunk=4)
    ids = {engine.submit(*r): k for k, r in enumerate(requests)}
    out, dropped = {k: ([], []) for k in range(len(requests))}, 0
    while engine.has_work():
        for e in engine.step():
            out[ids[e.request_id]][0].append(e.token)
            out[ids[e.request_id]][1].append(e.logprob)
        for r in engine.running:
            if len(r.tokens) - r.held == 1:  # decoding
                assert len(r.pages) - r.dropped <= -(-2 // page) + 1, (r.held, r.dropped)
            dropped = max(dropped, r.dropped)
    assert dropped > 0 and engine.stats()["pages_held"] == 0
    assert_generates(model, params, requests, out)
