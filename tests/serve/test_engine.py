"""The serving engine (jaxformer.serve.engine, jaxformer.serve.requests,
jaxformer.serve.paged_step) against generate and the training forward: greedy requests
arriving at random steps get generate's tokens alone and the forward's log-probs; a
seeded request samples the same tokens alone and in a busy batch; the top alternatives
are the forward's likeliest; the constraints are generate's; after a thousand requests,
cancellations among them, every page is free again; bad input is one line. One tiny model;
its programs compile once per process."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.logprobs import token_logprobs
from jaxformer.decode import generate
from jaxformer.decode.constraints import Constraints
from jaxformer.serve import Engine, RequestSettings

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="rope")
SLOTS, PAGE, CHUNK = 8, 8, 8
W, N = 20, 10  # the widest prompt, the most new tokens: each reference compiles once


@functools.cache
def initial(cfg: ModelConfig):
    """The model's init, once per config and process."""
    return jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def tiny(cfg: ModelConfig = CFG):
    """(model, params): init with its matrices moved by N(0, 0.15) drawn afresh (varied,
    confident distributions)."""
    params = jax.tree.map(lambda x: x + 0.15 * rng.standard_normal(x.shape, np.float32)
                          if x.ndim >= 2 else x, initial(cfg)["params"])
    return Transformer(cfg), params


def drive(engine, requests, arrivals, cancels=None):
    """Submit requests [(prompt, settings)] at their arrival steps (cancels: {index: the
    step it is cancelled at}), stepping until the engine is idle -> {index: (tokens,
    logprobs, finish reason)}, and the events' count of ends per request."""
    order = np.argsort(arrivals, kind="stable")
    ids, out, ends, step, i = {}, {}, {}, 0, 0
    cancels = cancels or {}
    while i < len(order) or engine.has_work():
        while i < len(order) and arrivals[order[i]] <= step:
            k = int(order[i])
            ids[engine.submit(*requests[k])] = k
            out[k] = ([], [], None)
            i += 1
        for k, when in cancels.items():
            if when == step and k in out:
                rid = next(r for r, kk in ids.items() if kk == k)
                engine.cancel(rid)
                engine.cancel(rid)  # idempotent
        for e in engine.step():
            k = ids[e.request_id]
            tokens, logps, _ = out[k]
            if e.token >= 0:
                tokens.append(e.token)
                logps.append(e.logprob)
            out[k] = (tokens, logps, e.finished)
            ends[k] = ends.get(k, 0) + (e.finished is not None)
        step += 1
        assert step < 20_000, "the engine does not finish"
    return out, ends


def generated(model, params, prompt, cache_dtype=None, **kw):
    """generate's greedy N tokens for the prompt alone (padded to W: one program)."""
    padded = np.zeros((1, W), np.int32)
    padded[0, :len(prompt)] = prompt
    return generate(model, params, padded, prompt_lengths=np.array([len(prompt)]),
                    max_new_tokens=N, rng=jax.random.key(0), temperature=0.0,
                    cache_dtype=cache_dtype, **kw)


def alone(model, params, prompt, n: int, **kw) -> list[int]:
    """generate's first n tokens for the prompt alone."""
    return np.asarray(generated(model, params, prompt, **kw).tokens[0, :n]).tolist()


@functools.cache
def _forward_logprobs(model):
    return jax.jit(functools.partial(token_logprobs, model))


def forward_logprobs(model, params, prompts, completions) -> list[np.ndarray]:
    """The training forward's log-probs of each completion after its prompt (one padded
    batch, width W + N)."""
    seqs = np.zeros((len(prompts), W + N), np.int32)
    segments = np.zeros_like(seqs)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        seqs[r, :len(p) + len(c)] = list(p) + list(c)
        segments[r, :len(p) + len(c)] = 1
    positions = np.broadcast_to(np.arange(W + N, dtype=np.int32), seqs.shape)
    logp = np.asarray(_forward_logprobs(model)(params, seqs, positions, segments))
    return [logp[r, len(p):len(p) + len(c)] for r, (p, c) in enumerate(zip(prompts, completions))]


def random_prompt(longest: int = W) -> list[int]:
    return rng.integers(0, CFG.vocab_size, int(rng.integers(1, longest + 1))).tolist()


def test_greedy_requests_arriving_at_random_steps_get_generates_tokens_alone():
    """64 greedy requests of mixed lengths arriving at random steps, through a pool small
    enough to preempt: each gets exactly generate's tokens for it alone, its log-probs the
    training forward's within 1e-5, and every page is free at the end."""
    model, params = tiny()
    requests = [(random_prompt(), RequestSettings(max_tokens=int(rng.integers(1, N + 1)),
                                                  temperature=0.0)) for _ in range(64)]
    engine = Engine(model, params, slots=SLOTS, page_size=PAGE, prefill_chunk=CHUNK, pages=12)
    out, ends = drive(engine, requests, rng.integers(0, 40, len(requests)))
    got = [out[k][0] for k in range(len(requests))]
    for (prompt, s), tokens in zip(requests, got):
        assert tokens == alone(model, params, prompt, s.max_tokens), prompt
    want = forward_logprobs(model, params, [p for p, _ in requests], got)
    np.testing.assert_allclose(np.concatenate([out[k][1] for k in range(len(requests))]),
                               np.concatenate(want), atol=1e-5, rtol=0)
    assert all(out[k][2] == "length" and ends[k] == 1 for k in range(len(requests)))
    assert engine.stats()["pages_held"] == 0 and engine.stats()["preempted"] > 0


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_busy_batch():
    """A sampled request with a seed (temperature, top-k, top-p, min-p) gives the same
    tokens alone and among 24 others arriving around it (sampled, seeded or not, and
    greedy); its log-probs are the forward's; another seed gives other tokens."""
    model, params = tiny()
    seed = int(rng.integers(2**40))
    mine = (random_prompt(), RequestSettings(max_tokens=N, temperature=1.3, top_k=40,
                                             top_p=0.95, min_p=0.01, seed=seed))
    others = [(random_prompt(), RequestSettings(
        max_tokens=int(rng.integers(1, N + 1)), temperature=float(rng.choice([0.0, 1.0])),
        seed=int(rng.integers(2**40)) if rng.random() < 0.5 else None)) for _ in range(24)]

    def run(requests, arrivals):
        engine = Engine(model, params, slots=SLOTS, page_size=PAGE, prefill_chunk=CHUNK)
        return drive(engine, requests, arrivals)[0]

    by_itself = run([mine], [0])[0]
    busy = run(others + [mine], list(rng.integers(0, 6, len(others))) + [3])[len(others)]
    assert by_itself[0] == busy[0] and len(busy[0]) == N
    np.testing.assert_allclose(busy[1], forward_logprobs(model, params, [mine[0]],
                                                         [busy[0]])[0], atol=1e-5, rtol=0)
    other_seed = (mine[0], RequestSettings(**{**mine[1].__dict__, "seed": seed + 1}))
    assert run([other_seed], [0])[0][0] != by_itself[0]


def test_the_top_alternatives_are_the_forwards_likeliest_tokens():
    """settings.logprobs k > 0: each event lists the k likeliest tokens and their
    log-probs under the training forward (its log-softmax, within 1e-5), likeliest first."""
    model, params = tiny()
    prompts = [random_prompt() for _ in range(4)]
    ks = [1, 3, 20, 0]
    engine = Engine(model, params, slots=SLOTS, page_size=PAGE, prefill_chunk=CHUNK)
    ids = [engine.submit(p, RequestSettings(max_tokens=4, logprobs=k)) for p, k in
           zip(prompts, ks)]
    events = {i: [] for i in ids}
    while engine.has_work():
        for e in engine.step():
            events[e.request_id].append(e)
    seqs = np.zeros((len(prompts), W + N), np.int32)
    for r, (p, i) in enumerate(zip(prompts, ids)):
        seqs[r, :len(p) + 4] = p + [e.token for e in events[i]]
    logits = np.asarray(jax.jit(model.apply)({"params": params}, seqs), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for r, (p, i, k) in enumerate(zip(prompts, ids, ks)):
        for t, e in enumerate(events[i]):
            row = logp[r, len(p) - 1 + t]
            assert len(e.top) == k and [x for x, _ in e.top] == list(np.argsort(-row)[:k])
            np.testing.assert_allclose([v for _, v in e.top], row[[x for x, _ in e.top]],
                                       atol=1e-5, rtol=0)
            assert abs(e.logprob - row[e.token]) < 1e-5


def test_stop_tokens_min_tokens_and_the_ngram_ban_are_generates_constraints():
    """Greedy requests with a stop token, min_tokens 3 and no_repeat_ngram 2 end where
    generate with eos_id and Constraints(min_new_tokens=3, no_repeat_ngram_size=2) ends,
    with the same tokens, the stop token emitted (finish "stop")."""
    model, params = tiny()
    prompts = [random_prompt() for _ in range(12)]
    banned = Constraints(no_repeat_ngram_size=2)
    free = [alone(model, params, p, N, constraints=banned) for p in prompts]
    # the stop token: the one that the most rows emit after their first 3 tokens and not
    # among them (min_tokens bans it there, which would change the row), so it is reached
    eos = int(np.bincount([t for f in free for t in set(f[3:]) - set(f[:3])] or [0],
                          minlength=CFG.vocab_size).argmax())
    settings = RequestSettings(max_tokens=N, temperature=0.0, stop_token_ids=(eos,),
                               min_tokens=3, no_repeat_ngram=2)
    engine = Engine(model, params, slots=SLOTS, page_size=PAGE, prefill_chunk=CHUNK)
    out, _ = drive(engine, [(p, settings) for p in prompts], [0] * len(prompts))
    stopped = 0
    for k, p in enumerate(prompts):
        want = alone(model, params, p, N, eos_id=eos,
                     constraints=Constraints(min_new_tokens=3, no_repeat_ngram_size=2))
        if eos in want:
            want = want[:want.index(eos) + 1]
        tokens, _, finished = out[k]
        assert tokens == want
        assert finished == ("stop" if want[-1] == eos and len(want) > 0 and
                            eos in want else "length")
        stopped += finished == "stop"
    assert stopped > 0  # the stop token was reached at least once


def test_every_page_is_free_after_a_thousand_requests_some_cancelled():
    """1,000 short requests (a few shared prefixes among them) through a pool short
    enough to preempt and evict, a fifth cancelled at a random step (waiting or running):
    each ends exactly once, and at the end no page is held and every page is free or
    cached, each counted once."""
    model, params = tiny()
    prefixes = [rng.integers(0, CFG.vocab_size, PAGE).tolist() for _ in range(3)]
    requests = []
    for _ in range(1000):
        head = prefixes[rng.integers(3)] if rng.random() < 0.5 else []
        requests.append((head + random_prompt(6), RequestSettings(
            max_tokens=int(rng.integers(1, 9)), temperature=float(rng.choice([0.0, 1.0])))))
    arrivals = np.sort(rng.integers(0, 300, len(requests)))
    cancels = {int(k): int(arrivals[k] + rng.integers(0, 4))
               for k in rng.choice(len(requests), 200, replace=False)}
    engine = Engine(model, params, slots=SLOTS, page_size=PAGE, prefill_chunk=CHUNK, pages=6)
    out, ends = drive(engine, requests, arrivals, cancels)
    assert sorted(ends) == list(range(len(requests))) and set(ends.values()) == {1}
    assert {out[k][2] for k in cancels} <= {"cancelled", "length"}
    assert sum(out[k][2] == "cancelled" for k in cancels) > 50
    host, stats = engine.host, engine.stats()
    assert not np.any(host.refs) and stats["pages_held"] == 0 and stats["preempted"] > 0
    assert sorted(host.free + list(host.idle)) == list(range(host.pages))
    assert stats["running"] == stats["waiting"] == 0 and engine.by_slot == [None] * SLOTS


@pytest.mark.parametrize("prompt, settings, words", [
    ([], RequestSettings(), "the prompt is empty"),
    ([3, 64], RequestSettings(), "[0, 64)"),
    (list(range(30)), RequestSettings(max_tokens=3), "max_seq_len=32"),
    ([1], RequestSettings(temperature=-1.0), "settings.temperature"),
    ([1], RequestSettings(top_p=0.0), "settings.top_p"),
    ([1], RequestSettings(top_k=65), "settings.top_k"),
    ([1], RequestSettings(seed=-1), "settings.seed"),
    ([1], RequestSettings(logprobs=21), "settings.logprobs"),
    ([1], RequestSettings(stop_token_ids=(64,)), "settings.stop_token_ids"),
    ([1], RequestSettings(max_tokens=0), "settings.max_tokens"),
    ([1], dict(max_tokens=3), "RequestSettings"),
])
def test_bad_input_is_one_line(prompt, settings, words):
    """A bad prompt or setting is a ValueError of one line naming it; nothing queued."""
    engine = Engine(*tiny(), slots=2, page_size=PAGE)
    with pytest.raises(ValueError) as e:
        engine.submit(prompt, settings)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not engine.has_work()


def test_hooks_steer_the_engine_as_they_steer_generate():
    """hooks= (a steering vector added to blocks.0.hook_resid_post, one head of
    blocks.1.attn.hook_z silenced): greedy requests arriving at random steps get the tokens
    and log-probs (within 1e-5) of generate(..., hooks=the same), which the hooks move; a
    pattern hook and an unknown name are refused at construction, in one line."""
    model, params = tiny()
    u = jnp.asarray(rng.standard_normal(CFG.d_model), jnp.float32)
    hooks = {"blocks.0.hook_resid_post": lambda x: x + 0.7 * u,
             "blocks.1.attn.hook_z": lambda z: z.at[:, :, 1].multiply(0.0)}
    requests = [(random_prompt(), RequestSettings(max_tokens=N, temperature=0.0))
                for _ in range(8)]
    engine = Engine(model, params, slots=4, page_size=PAGE, prefill_chunk=CHUNK, hooks=hooks)
    out, _ = drive(engine, requests, rng.integers(0, 6, len(requests)))
    padded = np.zeros((len(requests), W), np.int32)
    for r, (p, _) in enumerate(requests):
        padded[r, :len(p)] = p
    lengths = np.array([len(p) for p, _ in requests])
    want, plain = (generate(model, params, padded, prompt_lengths=lengths, max_new_tokens=N,
                            rng=jax.random.key(0), temperature=0.0, hooks=h)
                   for h in (hooks, None))
    for k in range(len(requests)):
        assert out[k][0] == np.asarray(want.tokens[k]).tolist(), k
        np.testing.assert_allclose(out[k][1], want.logprobs[k], atol=1e-5, rtol=0)
    assert np.max(np.abs(np.asarray(want.logprobs) - np.asarray(plain.logprobs))) > 0.1
    for bad, words in (({"blocks.0.attn.hook_pattern": lambda p: p}, "hook_pattern"),
                       ({"blocks.7.hook_resid_post": lambda x: x}, "no such hook point")):
        with pytest.raises(ValueError, match=words) as e:
            Engine(model, params, page_size=PAGE, hooks=bad)
        assert "\n" not in str(e.value)


def test_bad_engines_are_one_line():
    """Too few pages for one sequence, or an encoder, refused in one line."""
    model, params = tiny()
    with pytest.raises(ValueError, match=r"pages >= 4") as e:
        Engine(model, params, page_size=PAGE, pages=3)
    assert "\n" not in str(e.value)
    with pytest.raises(Exception, match="model.arch=encoder"):
        Engine(Transformer(CFG.replace(arch="encoder")), params)
