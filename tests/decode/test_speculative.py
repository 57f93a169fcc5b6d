"""Speculative decoding against plain decoding: greedy token for token, sampling by a
chi-square test of the joint distribution of three tokens against the model's own
conditionals; prompt lookup against a brute-force search. Fresh random weights and
prompts every run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate
from jaxformer.decode.sampling import Sampling
from jaxformer.decode.speculative import PROPOSERS, lookup_drafts
from jaxformer.positions.schemes import POSITION_SCHEMES
from tests.decode.test_loops import assert_follows_conditionals
from tests.test_layout import literal_lines

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
# a layer pattern per scheme, in turn: plain, sliding window (rings), scanned layers, and
# local (window 4) : global layers with one K/V head
SHAPES = [dict(), dict(sliding_window=5), dict(scan_layers=True),
          dict(n_kv_heads=1, layer_pattern=("local", "global"),
               layer_kinds={"local": {"window": 4}, "global": {}})]


@functools.cache
def initializer(cfg: ModelConfig):
    """The model's init, jitted once per config (eager, it runs op by op)."""
    return jax.jit(Transformer(cfg).init)


def make(**kw):
    cfg = ModelConfig(**{**dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4,
                                n_kv_heads=2, max_seq_len=48), **kw})
    params = initializer(cfg)(jax.random.key(int(rng.integers(1 << 30))),
                              jnp.zeros((1, 4), jnp.int32))["params"]
    return Transformer(cfg), jax.tree.map(lambda x: x * 3.0, params)  # sharp, varied


def ragged(batch, width, vocab):
    lengths = rng.integers(1, width + 1, batch).astype(np.int32)
    prompts = rng.integers(1, vocab, (batch, width)).astype(np.int32)
    for b, n in enumerate(lengths):
        prompts[b, n:] = 0
    return prompts, lengths


@pytest.mark.parametrize("position", list(POSITION_SCHEMES))
def test_greedy_with_a_draft_is_greedy(position):
    """Prompt lookup or (every other scheme) a random draft model, mostly refused so that
    rows roll back every round, gives the plain greedy tokens, log-probs and lengths,
    ragged rows with an EOS included (plain greedy's ended by the EOS rule: ended_at)."""
    i = list(POSITION_SCHEMES).index(position)
    model, params = make(position=position, **SHAPES[i % len(SHAPES)])
    draft = "prompt_lookup" if i % 2 else make(**{
        **SHAPES[(i + 1) % len(SHAPES)], "position": position, "d_model": 16, "n_heads": 2,
        "n_kv_heads": 1, "n_layers": 2})
    prompts, lengths = ragged(3, 7, 37)
    kw = dict(prompt_lengths=lengths, max_new_tokens=16, rng=jax.random.key(0),
              temperature=0.0)
    free = generate(model, params, prompts, **kw)
    eos = int(free.tokens[0, int(rng.integers(2, 12))])  # row 0 stops early
    tokens, ends, logprobs = ended_at(free, eos, pad_id=36)
    out = generate(model, params, prompts, **kw, eos_id=eos, pad_id=36, draft=draft,
                   draft_len=3 + i % 2)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.lengths, ends)
    np.testing.assert_allclose(out.logprobs, logprobs, rtol=1e-4, atol=1e-4)
    assert (np.asarray(out.accepted) <= np.asarray(out.drafted)).all()


def ended_at(free, eos: int, pad_id: int):
    """(tokens, lengths, log-probs) of plain greedy decoding with eos_id `eos`, from its
    tokens without one (`free`; one compiled decoder fewer): after a row's first `eos`,
    pad_id at log-prob 0, and its length ends at the EOS."""
    tokens, logprobs = np.array(free.tokens), np.array(free.logprobs)
    lengths = np.full(len(tokens), tokens.shape[1], np.int32)
    for r, row in enumerate(tokens):
        hit = np.flatnonzero(row == eos)
        if hit.size:
            lengths[r] = hit[0] + 1
            tokens[r, hit[0] + 1:], logprobs[r, hit[0] + 1:] = pad_id, 0.0
    return tokens, lengths, logprobs


def test_the_model_as_its_own_draft_keeps_every_draft():
    """A draft equal to the model proposes its greedy tokens: all kept, k + 1 tokens a
    round (the path where the draft's cache lacks its last draft); a row beside another
    prompt decodes as in the batch (the same shapes: the same compiled decoder)."""
    model, params = make(position="rope", sliding_window=6)
    prompts, lengths = ragged(2, 6, 37)
    kw = dict(prompt_lengths=lengths, max_new_tokens=17, rng=jax.random.key(0),
              temperature=0.0)
    plain = generate(model, params, prompts, **kw)
    out = generate(model, params, prompts, **kw, draft=(model, params), draft_len=3)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.drafted, 12)  # 1 + 4 rounds of 4 tokens: 17
    np.testing.assert_array_equal(out.accepted, 12)
    other, other_lengths = ragged(2, 6, 37)  # row 0 another prompt, row 1 the same
    other[1], other_lengths[1] = prompts[1], lengths[1]
    one = generate(model, params, other, **dict(kw, prompt_lengths=other_lengths),
                   draft=(model, params), draft_len=3)
    np.testing.assert_array_equal(one.tokens[1], plain.tokens[1])


def test_lookup_drafts_follow_the_latest_longest_match():
    """Against a brute-force search: the longest suffix (<= 3 tokens) seen earlier, its
    latest occurrence, the tokens after it, repeating with the period it implies."""
    for _ in range(200):
        c, k = 24, 3
        context = rng.integers(0, 4, c).astype(np.int32)
        end = int(rng.integers(1, c + 1))
        want = None
        for n in (3, 2, 1):
            if n > end:
                continue
            hits = [j for j in range(n - 1, end - 1)
                    if (context[j - n + 1:j + 1] == context[end - n:end]).all()]
            if hits:
                j = hits[-1]
                want = context[j + 1 + np.arange(k) % (end - 1 - j)]  # the text's period
                break
        if want is None:
            want = np.full(k, context[end - 1])
        got = lookup_drafts(jnp.asarray(context), end, k)
        np.testing.assert_array_equal(got, want, err_msg=f"{context} {end}")


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, draft", [
    (1.0, None, None, None, "model"), (0.8, 3, 0.9, None, "model"),
    (1.0, None, 0.9, None, "prompt_lookup"), (1.2, None, None, 0.2, "model")])
def test_sampling_with_a_draft_follows_the_models_conditionals(temperature, top_k, top_p,
                                                                min_p, draft):
    """20,000 rows of one prompt, 3 tokens each, with a draft of 2 tokens a round: the
    joint frequencies of the 125 continuations match p(x1) p(x2 | x1) p(x3 | x1, x2), each
    from a full forward of the model and filtered as np_distribution says (chi-square,
    cells expected below 5 pooled). Keeping drafts by the draft's own odds, or resampling
    a refused one from p instead of max(0, p - q), fails it."""
    model, params = make(position="alibi", vocab_size=5)
    if draft == "model":  # a different distribution from the model's
        draft = make(position="rope", vocab_size=5, d_model=16, n_heads=2, n_kv_heads=1,
                     n_layers=1)
    prompt, n = rng.integers(0, 5, (1, 4)).astype(np.int32), 20_000
    out = generate(model, params, np.repeat(prompt, n, 0), max_new_tokens=3,
                   rng=jax.random.key(int(rng.integers(1 << 30))),
                   sampling=Sampling(temperature, top_k, top_p, min_p), draft=draft, draft_len=2)
    assert 0 <= out.acceptance_rate <= 1
    assert_follows_conditionals(model, params, prompt, out.tokens, temperature, top_k, top_p,
                                min_p)


def test_width_new_tokens_and_draft_len_must_fit_max_seq_len():
    """prompt width + max_new_tokens + draft_len == max_seq_len decodes, with a learned
    position table whose rows end there, to the plain greedy tokens; one more, whichever
    of the three grows, is refused in one line naming draft_len, for a draft model too."""
    model = Transformer(ModelConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=2,
                                    n_kv_heads=1, max_seq_len=16, position="learned"))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                          shapes["params"])  # sharp: no near-ties
    prompts = rng.integers(1, 37, (1, 6)).astype(np.int32)
    kw = dict(rng=jax.random.key(0), temperature=0.0)
    w, n, k = 5, 7, 4  # 16: the boundary
    plain = generate(model, params, prompts[:, :w], max_new_tokens=n, **kw)
    out = generate(model, params, prompts[:, :w], max_new_tokens=n, draft="prompt_lookup",
                   draft_len=k, **kw)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    for w, n, k in [(6, 7, 4), (5, 8, 4), (5, 7, 5)]:
        for d in ("prompt_lookup", (model, params)):
            with pytest.raises(ValueError, match=rf"^prompt width {w} \+ max_new_tokens {n} "
                               rf"\+ draft_len {k} = 17 exceeds max_seq_len=16; [^\n]*$"):
                generate(model, params, prompts[:, :w], max_new_tokens=n, draft=d,
                         draft_len=k, **kw)


@pytest.mark.parametrize("draft", ["model", "prompt_lookup"])
def test_each_row_drafts_and_samples_with_its_own_settings(draft):
    """Speculative decoding with settings per row (a greedy row among sampled ones): row r's
    tokens and counts are those of the same batch and key with every row set as row r, and
    the greedy row's are plain greedy decoding's."""
    model, params = make(position="rope")
    if draft == "model":
        draft = make(position="rope", d_model=16, n_heads=2, n_kv_heads=1, n_layers=1)
    prompts, lengths = ragged(3, 6, 37)
    rows = Sampling(temperature=np.array([1.5, 0.0, 0.8], np.float32),
                    top_k=np.array([0, 0, 6]), top_p=np.array([1.0, 1.0, 0.9], np.float32),
                    min_p=np.array([0.05, 0.0, 0.0], np.float32))
    kw = dict(prompt_lengths=lengths, max_new_tokens=10, draft=draft, draft_len=3,
              rng=jax.random.key(int(rng.integers(1 << 30))))
    out = generate(model, params, prompts, sampling=rows, **kw)
    for r in range(3):
        alone = generate(model, params, prompts, sampling=Sampling(*(x[r] for x in rows)), **kw)
        for field in ("tokens", "logprobs", "lengths", "drafted", "accepted"):
            np.testing.assert_array_equal(getattr(out, field)[r], getattr(alone, field)[r],
                                          err_msg=f"{field} {r}")
    greedy = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=10,
                      rng=jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(out.tokens[1], greedy.tokens[1])


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_each_proposer_is_named_in_its_table_alone(name):
    """A proposer's name is a string on one line of the library, its table's: the rest of
    the code asks the table (generate's check, the CLI's --draft)."""
    assert len(literal_lines(name)) == 1, literal_lines(name)
