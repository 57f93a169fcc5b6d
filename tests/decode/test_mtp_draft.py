"""The mtp proposer (jaxformer.decode.speculative.mtp_proposer): its drafts' distributions
are the MTP modules' of the full training forward (Transformer(...)(mtp=True)) over the
context, round after round of taken-back drafts, chained past mtp_depth; greedy decoding
with it is plain greedy decoding (random models, ragged rows, and a model trained a few
steps with model.mtp_depth=1, decoded from the command line too), each round drafting from
the model's hidden states; sampling with it follows the model's conditionals; a model
without MTP modules is refused in one line (exit 2 from the command line)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer.generate as generate_module
from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.decode.sampling import Sampling, branches_of, checked_sampling
from jaxformer.decode.speculative import RowState, mtp_proposer
from jaxformer.generate import main as generate_main
from jaxformer.training import train
from jaxformer.training.saved_run import load_run
from tests.decode.test_loops import assert_follows_conditionals
from tests.training.test_loop import config, corpus  # noqa: F401 (the fixture)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


@functools.cache
def initializer(cfg: ModelConfig):
    """The model's init, jitted once per config (eager, it runs op by op)."""
    return jax.jit(Transformer(cfg).init)


def make(**kw):
    cfg = ModelConfig(**{**dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                max_seq_len=48, norm="rmsnorm", ffn="swiglu", use_bias=False,
                                tie_embeddings=False, mtp_depth=2), **kw})
    params = initializer(cfg)(jax.random.key(int(rng.integers(1 << 30))),
                              jnp.zeros((1, 4), jnp.int32))["params"]
    return Transformer(cfg), jax.tree.map(lambda x: x * 3.0, params)  # sharp, varied


def chained(forward, d, context, pos, k):
    """Each draft's logits at position pos - 1 from full forwards over the context (fixed
    length: causal, what follows does not count) with the drafts before it (their argmax)
    written after pos: depths 1..D from the training forward, past D module D run
    (without a cache) on the previous depth's hidden state."""
    toks, out = np.array(context), []
    for m in range(1, k + 1):
        if m <= d:
            logits = forward(toks[None], mtp=True)[1][m - 1, 0, pos - 1]
        else:
            h = forward(toks[None], hidden=True)[1]
            for j in range(1, m + 1):
                nxt = np.concatenate([toks[j:], np.zeros(j, np.int32)])[None]
                z, h = forward(nxt, previous=h, depth=min(j, d))
            logits = z[0, pos - 1]
        out.append(np.asarray(logits))
        toks[pos + m] = int(np.argmax(logits))
    return np.stack(out)


def test_drafts_are_the_modules_of_the_full_forward(k=3):
    """Rounds of the proposer on one row, each keeping a random number of its drafts (then
    a random token, the model's own): each round's draft distributions are those of the
    full forward (k = 3 chains module 2 past mtp_depth=2)."""
    model, params = make()
    forward = jax.jit(lambda x, **kw: model.apply({"params": params}, x, **kw),
                      static_argnames=("mtp", "hidden", "depth"))
    w, length, max_len = 7, 5, 24
    context = rng.integers(1, 37, max_len + 1).astype(np.int32)
    prompt = jnp.asarray(np.where(np.arange(w) < length, context[:w], 0))
    proposer = mtp_proposer(model, k, 37)
    hidden = model.apply({"params": params}, prompt[None], hidden=True)[1][0]
    state = jax.jit(lambda h: proposer.start(params, prompt, jnp.int32(length), max_len, None,
                                             False, h))(hidden)
    sampling = checked_sampling(Sampling(temperature=0.0), 1, 37)
    propose = jax.jit(lambda state, row, pos: proposer.propose(
        params, state, row, pos, jax.random.key(0), jax.tree.map(lambda x: x[0], sampling),
        branches_of(sampling)))
    pos = length
    for _ in range(4):
        full = forward(context[None], hidden=True)[1][0]  # (what follows pos: garbage)
        row = RowState(None, state, jnp.asarray(context), None, None, None, None, None, None,
                       None, None, None, hidden=full)
        drafts, probs, state = propose(state, row, jnp.int32(pos))
        want = chained(forward, model.cfg.mtp_depth, context, pos, k)
        np.testing.assert_allclose(probs, jax.nn.softmax(want), rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(drafts, np.argmax(want, -1))
        a = int(rng.integers(0, k + 1))  # a drafts kept, then a token of the model's own
        context[pos + 1:pos + 1 + a] = drafts[:a]
        pos += a + 1


@pytest.mark.parametrize("k, shape", [(2, {}), (3, {"sliding_window": 5, "scan_layers": True})])
def test_greedy_with_mtp_drafts_is_greedy(k, shape):
    """Ragged rows: the plain greedy tokens, lengths and log-probs, with windowed and
    scanned layers too."""
    model, params = make(**shape)
    lengths = rng.integers(1, 8, 3).astype(np.int32)
    prompts = rng.integers(1, 37, (3, 7)).astype(np.int32) * (np.arange(7) < lengths[:, None])
    kw = dict(prompt_lengths=lengths, max_new_tokens=14, rng=jax.random.key(0), temperature=0.0)
    plain = generate(model, params, prompts, **kw)
    out = generate(model, params, prompts, **kw, draft="mtp", draft_len=k)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_allclose(out.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)


def replayed(ahead, seq, start, max_new):
    """(rounds, drafts kept) of greedy decoding with one draft a round, ahead[i] the draft
    made at position i + 1 (module 1's argmax at i), seq the prompt and greedy tokens."""
    pos, n, kept, rounds = start, 1, 0, 0
    while n < max_new:
        a = int(ahead[pos - 1] == seq[pos + 1])
        pos, n, kept, rounds = pos + a + 1, n + a + 1, kept + a, rounds + 1
    return rounds, kept


def test_rounds_draft_from_the_models_hidden_states():
    """A random model of 5 tokens whose module reads the hidden state alone (enorm's scale
    0): each row's drafts kept are those replayed from one full forward over its greedy
    text, so each round read the hidden state of the position before its last token. The
    first of a few fresh models whose replay keeps at least 4 drafts is decoded (a greedy
    text can settle in a cycle its module never drafts right: a check of nothing)."""
    lengths = np.array([3, 6], np.int32)
    kw = dict(prompt_lengths=lengths, max_new_tokens=30, rng=jax.random.key(0), temperature=0.0)
    for _ in range(8):
        model, params = make(vocab_size=5, mtp_depth=1)
        params["mtp_1"]["enorm"]["scale"] = jnp.zeros_like(params["mtp_1"]["enorm"]["scale"])
        prompts = rng.integers(0, 5, (2, 6)).astype(np.int32)
        plain = generate(model, params, prompts, **kw)
        want = []
        for r, n in enumerate(lengths):
            seq = np.concatenate([prompts[r, :n], np.asarray(plain.tokens[r])])
            ahead = np.argmax(model.apply({"params": params}, seq[None], mtp=True)[1][0, 0], -1)
            want.append(replayed(ahead, seq, n, 30))
        if sum(kept for _, kept in want) >= 4:
            break
    else:
        pytest.fail("no model of 8 kept 4 drafts in its replay")
    out = generate(model, params, prompts, **kw, draft="mtp", draft_len=1)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert [(int(d), int(a)) for d, a in zip(out.drafted, out.accepted)] == want


def test_sampling_with_mtp_drafts_follows_the_models_conditionals():
    """20,000 rows of one prompt, 3 tokens each at temperature 0.9 and top-k 4, drafting 2
    a round (module 1, then chained): the joint frequencies of the continuations match the
    model's own filtered conditionals (test_loops.assert_follows_conditionals)."""
    model, params = make(vocab_size=5, mtp_depth=1)
    prompt = rng.integers(0, 5, (1, 4)).astype(np.int32)
    out = generate(model, params, np.repeat(prompt, 20_000, 0), max_new_tokens=3,
                   rng=jax.random.key(int(rng.integers(1 << 30))),
                   sampling=Sampling(0.9, 4, None, None), draft="mtp", draft_len=2)
    assert 0 < out.acceptance_rate < 1
    assert_follows_conditionals(model, params, prompt, out.tokens, 0.9, 4, None)


def test_a_model_without_modules_is_refused():
    model, params = make(mtp_depth=0)
    with pytest.raises(ValueError, match=r"^draft=mtp drafts with the model's multi-token "
                       r"prediction modules, and this model has none \(model.mtp_depth=0\)$"):
        generate(model, params, np.ones((1, 3), np.int32), max_new_tokens=4,
                 rng=jax.random.key(0), draft="mtp", draft_len=1)


def test_trained_model_decodes_its_greedy_tokens(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A few steps of training with model.mtp_depth=1 (the MTP loss logged and falling),
    then draft='mtp' gives plain greedy's tokens, in Python and from the command line; the
    command line refuses a run without MTP modules with exit 2."""
    run = tmp_path / "run"
    train(config(corpus, run, "train.steps=30", "train.eval_every=30", "checkpoint.every=30",
                 "train.sample_tokens=0", "model.mtp_depth=1", "optim.lr=1e-2"),
          log=lambda *a: None)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    mtp = [r["mtp_loss_1"] for r in records if "mtp_loss_1" in r]
    assert len(mtp) == 30 and mtp[-1] < mtp[0] - 0.5, mtp
    assert any("val_mtp_loss_1" in r for r in records)
    model, params, tok = load_run(str(run))
    prompt = np.asarray(tok.encode("def x"), np.int32)[None]
    kw = dict(max_new_tokens=12, rng=jax.random.key(0), temperature=0.0)
    plain = generate(model, params, prompt, **kw)
    out = generate(model, params, prompt, **kw, draft="mtp", draft_len=1)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert out.acceptance_rate > 0.2  # the module learnt something of the text
    # each round's draft is module 1's argmax at the position before the last token, from
    # one full forward over the greedy text: the rounds replayed count the same drafts
    seq = np.concatenate([prompt[0], np.asarray(plain.tokens[0])])
    ahead = np.argmax(model.apply({"params": params}, seq[None], mtp=True)[1][0, 0], -1)
    assert (int(out.drafted[0]), int(out.accepted[0])) == replayed(ahead, seq, len(prompt[0]),
                                                                   12)
    # the command line: the same prompt and length, so the same compiled decoder
    assert generate_main(["--run", str(run), "--prompt", "def x", "--max-new-tokens", "12",
                          "--temperature", "0", "--draft", "mtp"]) == 0
    assert "draft acceptance rate: " in capsys.readouterr().err
    bare = Transformer(model.cfg.replace(mtp_depth=0))
    monkeypatch.setattr(generate_module, "load_run", lambda *a, **kw: (bare, params, tok))
    assert generate_main(["--run", str(run), "--prompt", "def", "--draft", "mtp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: draft=mtp drafts") and "\n" not in err
