"""objective.name=mlm (jaxformer.training.mlm): the masked loss against a float64 NumPy
reference given the same corruption, BERT's 80/10/10 rule on a large batch, the
end-of-text token never chosen (the others at mask_rate), the one-line refusals, and a
run of train() whose val loss is the masked one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Transformer
from jaxformer.data.tokenizer import ByteTokenizer, load_tokenizer
from jaxformer.model.config import ConfigError
from jaxformer.positions import segment_positions
from jaxformer.training import load_config, objectives, train
from jaxformer.training.mlm import MaskedLM, corrupt
from jaxformer.training.step import make_eval_step
from tests.conftest import np_log_softmax
from tests.model.test_transformer import np_forward

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

RUN = ["model.preset=tiny", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
       "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4", "train.log_every=1",
       "train.eval_batches=2", "train.progress=false", "optim.warmup_steps=0",
       "model.arch=encoder", "objective.name=mlm"]


class ByteTokenizerWithEot(ByteTokenizer):
    """The byte tokenizer with one of its ids taken as the end-of-text."""

    def __init__(self, eot_id):
        self.eot_id = eot_id


def np_masked_loss(cfg, params, tokens, corrupted, chosen, pos, seg):
    """The mean float64 cross entropy of the original tokens at the chosen positions,
    from the float64 forward of the corrupted ones."""
    logp = np_log_softmax(np_forward(cfg, params, corrupted, pos, seg))
    nll = -np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    return nll[chosen].mean()


def test_the_masked_loss_equals_a_float64_reference():
    """The train step's loss (gradient_sums, its corruption from the step's key) and the
    eval step's are the mean cross entropy at the chosen positions of the model's float64
    forward of the corrupted row; only chosen, non-padding tokens change."""
    cfg = load_config(None, [*RUN, "objective.mask_rate=0.3"])
    model, obj = Transformer(cfg.model), MaskedLM.of(cfg)
    seg = np.array([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4])
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    tokens = rng.integers(0, 255, seg.shape).astype(np.int32)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    batch = {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(tokens),
             "loss_mask": jnp.ones(seg.shape, jnp.float32), "positions": jnp.asarray(pos),
             "segment_ids": jnp.asarray(seg)}
    step_rng = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    total, count, _, _ = jax.jit(lambda p, b, r: obj.gradient_sums(model, p, {}, b, r))(
        params, batch, step_rng)
    key = jax.random.split(step_rng)[0]  # the step's: the other half is dropout's
    corrupted, chosen = (np.asarray(x) for x in corrupt(
        key, jnp.asarray(tokens), jnp.asarray(seg > 0), rate=0.3, mask_id=255, vocab_size=256))
    assert chosen.sum() > 0 and not chosen[seg == 0].any()
    assert (corrupted[~chosen] == tokens[~chosen]).all()
    assert int(count) == chosen.sum()
    want = np_masked_loss(cfg.model, params, tokens, corrupted, chosen, pos, seg)
    np.testing.assert_allclose(float(total) / float(count), want, rtol=1e-4)
    t, c, _ = make_eval_step(model, objective=obj)(params, batch)
    seed = int(tokens.astype(np.uint64).sum() % 2**32)
    key = jax.random.fold_in(jax.random.PRNGKey(0x6D6C6D), seed)
    corrupted, chosen = (np.asarray(x) for x in corrupt(
        key, jnp.asarray(tokens), jnp.asarray(seg > 0), rate=0.3, mask_id=255, vocab_size=256))
    np.testing.assert_allclose(float(t) / float(c), np_masked_loss(
        cfg.model, params, tokens, corrupted, chosen, pos, seg), rtol=1e-4)


@pytest.mark.parametrize("vocab", [4, 256])
def test_bert_rule_80_10_10_on_a_large_batch(vocab):
    """Of ~20k chosen tokens: mask_rate of the eligible ones chosen, 80% become the mask
    id, 10% another token (never the mask id: with 4 ids a draw that could be it would
    show), 10% stay (a random draw may also land on the token itself: 1 / (V - 1) of the
    10%); padding is never chosen; each within 5 sigma."""
    mask_id, rate = int(rng.integers(0, vocab)), 0.15
    tokens = rng.integers(0, vocab, (128, 1024))
    tokens[tokens == mask_id] = (mask_id + 1) % vocab
    eligible = rng.random(tokens.shape) < 0.9
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    out, chosen = (np.asarray(x) for x in jax.jit(
        lambda k, t, e: corrupt(k, t, e, rate=rate, mask_id=mask_id, vocab_size=vocab))(
            key, jnp.asarray(tokens, jnp.int32), jnp.asarray(eligible)))
    assert not chosen[~eligible].any() and (out[~chosen] == tokens[~chosen]).all()
    assert out.min() >= 0 and out.max() < vocab

    def within(hits, n, p):
        assert abs(hits - n * p) < 5 * np.sqrt(n * p * (1 - p)), (hits, n, p)

    n = int(chosen.sum())
    within(n, int(eligible.sum()), rate)
    masked = out[chosen] == mask_id
    kept = out[chosen] == tokens[chosen]
    other = ~masked & ~kept
    within(int(masked.sum()), n, 0.8)
    within(int(other.sum()), n, 0.1 * (1 - 1 / (vocab - 1)))
    within(int(kept.sum()), n, 0.1 + 0.1 / (vocab - 1))
    again = np.asarray(corrupt(jax.random.fold_in(key, 1), jnp.asarray(tokens, jnp.int32),
                               jnp.asarray(eligible), rate=rate, mask_id=mask_id,
                               vocab_size=vocab)[1])
    assert (again != chosen).any()  # another step, other positions


def test_the_end_of_text_token_is_never_chosen_and_the_rest_at_the_rate():
    """With the tokenizer's end-of-text id (objectives.build gives it to MaskedLM), the
    train step chooses the positions a draw from its key chooses among the non-padding,
    non-end-of-text tokens (its count and its loss, against a float64 reference at those
    positions), so no end-of-text is ever chosen; over 12 random batches (about 1/5 of
    their tokens the end-of-text) the chosen share of the others is mask_rate, within
    6 sigma of its binomial spread."""
    rate = float(rng.uniform(0.1, 0.5))
    cfg = load_config(None, [*RUN, "model.d_model=16", "model.n_layers=1",
                             f"objective.mask_rate={rate}"])
    eot = int(rng.integers(0, 255))
    obj = objectives.build(cfg, ByteTokenizerWithEot(eot))
    assert obj == MaskedLM(rate, 255, 256, eot)
    model = Transformer(cfg.model)
    rows, width = 16, 32
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        np.zeros((rows, width), np.int32))["params"]
    step = jax.jit(lambda p, b, r: obj.gradient_sums(model, p, {}, b, r))
    chosen_total = others_total = 0
    for i in range(12):
        tokens = rng.integers(0, 255, (rows, width)).astype(np.int32)
        tokens[rng.random(tokens.shape) < 0.2] = eot  # documents' ends
        seg = np.ones(tokens.shape, np.int32)
        for r in range(rows):  # a padded tail in some rows
            seg[r, int(rng.integers(width // 2, width + 1)):] = 0
        pos = np.asarray(segment_positions(jnp.asarray(seg)))
        batch = {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(tokens),
                 "loss_mask": jnp.ones(seg.shape, jnp.float32),
                 "positions": jnp.asarray(pos), "segment_ids": jnp.asarray(seg)}
        step_rng = jax.random.PRNGKey(int(rng.integers(1 << 30)))
        total, count, _, _ = step(params, batch, step_rng)
        others = (seg > 0) & (tokens != eot)
        key = jax.random.split(step_rng)[0]  # the step's: the other half is dropout's
        corrupted, chosen = (np.asarray(x) for x in corrupt(
            key, jnp.asarray(tokens), jnp.asarray(others), rate=rate, mask_id=255,
            vocab_size=256))
        assert int(count) == chosen.sum() and not chosen[tokens == eot].any()
        if i == 0:
            want = np_masked_loss(cfg.model, params, tokens, corrupted, chosen, pos, seg)
            np.testing.assert_allclose(float(total) / float(count), want, rtol=1e-4)
        chosen_total += int(count)
        others_total += int(others.sum())
    spread = np.sqrt(others_total * rate * (1 - rate))
    assert abs(chosen_total - rate * others_total) < 6 * spread, (chosen_total, others_total)


def test_a_run_gives_the_masking_its_tokenizers_end_of_text(tmp_path, monkeypatch):
    """train() with a BPE tokenizer (its <|endoftext|> after every document) builds the
    step's MaskedLM with that id."""
    built = []

    def build(cfg, tokenizer=None):
        built.append(real(cfg, tokenizer))
        return built[-1]
    real = objectives.build
    monkeypatch.setattr(objectives, "build", build)
    docs = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], 12)) for _ in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train(load_config(None, [
        *RUN, "model.d_model=16", "model.n_layers=1", "model.vocab_size=300",
        f"data.path={tmp_path / 'docs.jsonl'}", "data.tokenizer=bpe",
        f"data.cache_dir={tmp_path / 'c'}", "train.steps=1",
        "train.eval_every=100", "train.sample_tokens=0", f"train.run_dir={tmp_path / 'run'}"]),
        log=lambda *a: None)
    eot = load_tokenizer(tmp_path / "run").eot_id
    assert eot is not None and built[-1].eot_id == eot


@pytest.mark.parametrize("args, match", [
    (["model.arch=decoder"], "objective.name=mlm with model.arch=decoder"),
    (["objective.name=lm"], "objective.name=lm with model.arch=encoder"),
    (["objective.mask_rate=0"], "objective.mask_rate=0"),
    (["objective.mask_id=256"], "objective.mask_id=256 must be below model.vocab_size=256"),
])
def test_bad_settings_are_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [*RUN, *args])
    assert "\n" not in str(e.value)


def test_a_run_trains_and_evaluates_the_masked_loss(tmp_path):
    """train(): an encoder with mlm takes steps and is evaluated on the masked loss (a
    mask id's cross entropy near log V at the start, lower after), and draws no sample
    (an encoder has no generation)."""
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300))
    (tmp_path / "corpus.txt").write_text(text)
    summary = train(load_config(None, [
        *RUN, f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'c'}",
        "train.steps=12", "train.eval_every=100", "optim.lr=1e-2", "train.sample_tokens=8",
        f"train.run_dir={tmp_path / 'run'}"]), log=lambda *a: None)
    assert summary["step"] == 12 and np.isfinite(summary["val_loss"])
    assert summary["val_loss"] < np.log(256) - 1.0
    assert not (tmp_path / "run" / "sample.txt").exists()
