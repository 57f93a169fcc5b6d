"""The encoder-decoder's training (jaxformer.training.seq2seq, data.format=seq2seq:
jaxformer.data.seq2seq): label smoothing against float64 NumPy and the step's update
against the smoothed loss's gradient, batches packed on both sides read back against the
records, every packed row drawn, a run that learns to translate, and one-line errors for
bad input."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from jaxformer import ModelConfig
from jaxformer.data import DataConfig, load_dataset
from jaxformer.data.completions import Records
from jaxformer.data.seq2seq import pack_pairs, pairs_batch
from jaxformer.training.saved_run import load_run
from jaxformer.model.build import model_for
from jaxformer.training import load_config, objectives, train
from jaxformer.training.seq2seq import smoothed_cross_entropy
from jaxformer.training.step import init_state, make_train_step
from tests.conftest import REPO, np_log_softmax

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

_spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

END = 256  # the bytes tokenizer has no end-of-text id: a target's start and end
RUN = ["model.arch=encoder_decoder", "model.vocab_size=257", "model.d_model=32",
       "model.n_heads=2", "model.n_layers=1", "model.encoder_layers=1", "model.max_seq_len=64",
       "data.format=seq2seq", "train.seq_len=48", "train.batch_size=8", "train.progress=false",
       "train.sample_tokens=0", "train.eval_batches=2"]


def test_label_smoothing_equals_float64_reference():
    v, e = int(rng.integers(3, 40)), float(rng.uniform(0.01, 0.5))
    logits = rng.normal(0, 3, (4, 5, v)).astype(np.float32)
    targets = rng.integers(0, v, (4, 5))
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    q = (1 - e) * np.eye(v)[targets] + e / v
    want = -(q * logp).sum(-1)
    np.testing.assert_allclose(smoothed_cross_entropy(logits, targets, e), want, rtol=1e-5)


def random_records(n, low, high, vocab):
    """n records of random ids in [0, vocab), each of low to high tokens."""
    lengths = rng.integers(low, high + 1, n)
    tokens = rng.integers(0, vocab, int(lengths.sum())).astype(np.int32)
    return Records(tokens, np.ones(len(tokens), np.uint8),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def test_the_step_follows_the_smoothed_loss_gradient():
    """With plain SGD at lr 1000 the step moves each param by -1000 times its gradient: that
    is jax.grad of a smoothed cross entropy written here from the model's logits (target
    distribution (1 - e) one-hot + e / V, summed over the target tokens and divided by
    their count), on packed pairs with padding, within float32 rounding of the params; the
    unsmoothed gradient is far from it, and the loss logged is the plain cross entropy
    (float64)."""
    e, v = float(rng.uniform(0.1, 0.5)), 257
    cfg = load_config(None, [*RUN, f"optim.label_smoothing={e}", "data.path=number_words",
                              "model.max_seq_len=16"])
    model, objective = model_for(cfg.model), objectives.build(cfg)
    sources, targets = random_records(12, 1, 8, 256), random_records(12, 1, 7, 256)
    bounds, _ = pack_pairs(sources, targets, 16)
    batch = pairs_batch(sources, targets, bounds, np.arange(4), 16, end=256)
    lr = 1000.0  # updates well above the params' float32 spacing
    tx = optax.apply_if_finite(optax.sgd(lr), 10)
    state = init_state(model, tx, int(rng.integers(1 << 30)))
    params = jax.device_get(state.params)

    def logits_of(p):
        return model.apply({"params": p}, batch["sources"], batch["inputs"],
                           source_segment_ids=batch["source_segment_ids"],
                           target_segment_ids=batch["segment_ids"],
                           source_positions=batch["source_positions"],
                           target_positions=batch["positions"])

    def reference_loss(p, smoothing):
        logp = jax.nn.log_softmax(logits_of(p).astype(jnp.float32), -1)
        q = (1 - smoothing) * jax.nn.one_hot(batch["targets"], v) + smoothing / v
        mask = batch["loss_mask"]
        return -jnp.sum(q * logp * mask[..., None]) / jnp.sum(mask)

    grad = jax.jit(jax.grad(reference_loss))
    want, plain = grad(params, e), grad(params, 0.0)
    new, m = make_train_step(model, tx, lambda s: 1.0, objective=objective)(state, batch)
    got = jax.tree.map(lambda a, b: (np.float64(a) - np.float64(b)) / lr,
                       params, jax.device_get(new.params))
    far, top = 0.0, max(np.abs(w).max() for w in jax.tree.leaves(want))
    for (path, g), w, u, p in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                  jax.tree.leaves(want), jax.tree.leaves(plain),
                                  jax.tree.leaves(params)):
        w, u, scale = np.asarray(w, np.float64), np.asarray(u, np.float64), np.abs(w).max()
        rounding = np.spacing(np.float32(np.abs(p).max() + lr * scale)) / lr  # the new params'
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale + 1e-6 * top + rounding,
                                   err_msg=jax.tree_util.keystr(path))
        far = max(far, np.abs(u - w).max() / (scale + 1e-30))
    assert far > 1e-2  # the smoothing moves the gradient: the check above can tell
    logp = np_log_softmax(jax.jit(logits_of)(params))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    assert float(m["loss"]) == pytest.approx((nll * mask).sum() / mask.sum(), rel=1e-5)


def words(n):
    return " ".join("".join(rng.choice(list("abcdefgh"), int(rng.integers(1, 5))))
                    for _ in range(n))


def write_pairs(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_batches_pack_pairs_on_both_sides(tmp_path):
    """Each segment k of a row's source and of its target is one record's source and
    target (bytes), the target's inputs starting with END and its targets ending with it,
    positions restarting per segment; the loss on every target token, none on padding."""
    records = [{"src": f"{i} {words(int(rng.integers(1, 4)))}",
                "tgt": words(int(rng.integers(1, 3)))} for i in range(200)]
    path = write_pairs(tmp_path / "pairs.jsonl", records)
    data = load_dataset(DataConfig(path=str(path), format="seq2seq", source_field="src",
                                   target_field="tgt", cache_dir=str(tmp_path / "c")),
                        vocab_size=257, log=lambda *a: None)
    pairs = {r["src"]: r["tgt"] for r in records}
    batch = data.train_batch(seed=0, step=int(rng.integers(100)), batch_size=4, seq_len=40)
    seen = 0
    for r in range(4):
        seg, src_seg = batch["segment_ids"][r], batch["source_segment_ids"][r]
        assert set(seg) - {0} == set(src_seg) - {0}
        for k in sorted(set(seg) - {0}):
            source = bytes(batch["sources"][r][src_seg == k].tolist()).decode()
            target = pairs[source].encode()
            np.testing.assert_array_equal(batch["inputs"][r][seg == k], [END, *target])
            np.testing.assert_array_equal(batch["targets"][r][seg == k], [*target, END])
            np.testing.assert_array_equal(batch["positions"][r][seg == k],
                                          np.arange(len(target) + 1))
            np.testing.assert_array_equal(batch["source_positions"][r][src_seg == k],
                                          np.arange(len(source)))
            seen += 1
        np.testing.assert_array_equal(batch["loss_mask"][r], seg > 0)
    assert seen > 4  # rows hold several pairs


def test_training_draws_every_packed_row(tmp_path):
    """Pairs whose sources each fill more than half of seq_len pack one to a row, in
    order: over 60 steps of 8 rows every train row is drawn (the last one included), each
    at least a third of its expected 480 / n times; a batch is a pure function of (seed,
    step), and a process's slice of rows is that slice of the whole batch."""
    n = int(rng.integers(5, 10))
    records = [{"source": f"{i:02d}" + words(1) * 4, "target": words(1)}
               for i in range(n + 1)]
    for r in records:
        r["source"] = (r["source"] + "x" * 16)[:int(rng.integers(9, 17))]
    data = load_dataset(DataConfig(path=str(write_pairs(tmp_path / "p.jsonl", records)),
                                   format="seq2seq", val_fraction=1 / (n + 1),
                                   cache_dir=str(tmp_path / "c")),
                        vocab_size=257, log=lambda *a: None)
    sources = [bytes(s.tolist()).decode() for s in np.split(data.train[0].tokens,
                                                            data.train[0].offsets[1:-1])]
    assert len(sources) == n and len(data.packed("train", 16)) == n + 1  # a pair a row
    seed, drawn = int(rng.integers(1 << 30)), []
    for step in range(60):
        batch = data.train_batch(seed=seed, step=step, batch_size=8, seq_len=16)
        assert (batch["source_segment_ids"].max(1) == 1).all()
        drawn += [bytes(row[row > 0].tolist()).decode() for row in batch["sources"]]
    counts = np.array([drawn.count(s) for s in sources])
    assert counts.sum() == 480 and (counts >= 480 / n / 3).all(), (counts, sources)
    step = int(rng.integers(1000))
    batch = data.train_batch(seed=seed, step=step, batch_size=8, seq_len=16)
    again = data.train_batch(seed=seed, step=step, batch_size=8, seq_len=16)
    part = data.train_batch(seed=seed, step=step, batch_size=8, seq_len=16, rows=slice(2, 5))
    for k in batch:
        np.testing.assert_array_equal(again[k], batch[k])
        np.testing.assert_array_equal(part[k], batch[k][2:5])


def test_a_run_learns_to_translate(tmp_path):
    """60 steps on a letter cipher (abcd -> wxyz, 1 to 4 letters): the val cross entropy
    per target token falls well below what a model blind to the source can reach (its
    letters uniform, ln 4 = 1.39 nats, and the end token after 1 to 4 of them). T5 v1.1's
    tables: one input table, a head of its own (the other runs here tie all three). The
    loss goes through that head 8 target positions at a time (model.loss_chunk: equal to
    the plain loss, tests/training/test_chunked_loss.py)."""
    cipher = dict(zip("abcd", "wxyz"))
    sources = ["".join(rng.choice(list("abcd"), int(rng.integers(1, 5)))) for _ in range(600)]
    path = write_pairs(tmp_path / "cipher.jsonl", [
        {"source": s, "target": "".join(cipher[c] for c in s)} for s in sources])
    summary = train(load_config(None, [
        *RUN, f"data.path={path}", f"data.cache_dir={tmp_path / 'c'}", "model.d_model=64",
        "model.n_heads=4", "model.tie_embeddings=false", "model.tie_source_embed=true",
        "train.steps=60", "train.eval_every=100", "optim.lr=2e-3",
        "optim.schedule=constant", "optim.warmup_steps=5", "optim.label_smoothing=0.1",
        "data.val_fraction=0.3", f"train.run_dir={tmp_path / 'r'}", "model.loss_chunk=8"]),
        log=lambda *a: None)
    assert summary["val_loss"] < 1.0, summary
    with pytest.raises(ValueError, match="is an encoder-decoder .*experiments.translate --run"):
        load_run(str(tmp_path / "r"))  # python -m jaxformer.generate's: it continues prompts


def decoder_run(tmp_path):
    """A decoder-only run dir holding only its config (what train.init_from reads first)."""
    run = tmp_path / "lm"
    run.mkdir()
    model = ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": model.to_dict()}))
    return run


def test_bad_input_stops_in_one_line(tmp_path, capsys):
    records = [{"source": words(2), "target": words(1)} for _ in range(6)]
    good = write_pairs(tmp_path / "good.jsonl", records)
    del records[2]["target"]
    path = write_pairs(tmp_path / "pairs.jsonl", records)
    args = [*RUN, f"data.path={path}", f"train.run_dir={tmp_path / 'r'}",
            f"data.cache_dir={tmp_path / 'c'}"]
    no = lambda prefix: [a for a in args if not a.startswith(prefix)]  # noqa: E731
    cases = [(args, [f"{path}:3: field 'target' is missing", "data.target_field"]),
             (no("model.arch") and [a for a in no("model.arch") if "encoder_layers" not in a],
              ["model.arch=decoder with data.format=seq2seq"]),
             (no("data.format"), ["model.arch=encoder_decoder with data.format=text"]),
             ([a for a in no("model.arch") if "encoder_layers" not in a and "format" not in a]
              + ["optim.label_smoothing=0.1"],
              ["optim.label_smoothing=0.1", "model.arch=encoder_decoder"]),
             (args + [f"data.path={good}", "model.vocab_size=256"],
              ["id 256", "model.vocab_size >= 257"]),
             ([a for a in no("model.") if a != "data.format=seq2seq"] + [
                 "data.format=seq2seq", "model.arch=encoder_decoder", f"data.path={good}",
                 f"train.init_from={decoder_run(tmp_path)}"],
              ["model.arch='encoder_decoder' differs from 'decoder'"])]
    for argv, needles in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        for needle in needles:
            assert needle in err, (needle, err)
