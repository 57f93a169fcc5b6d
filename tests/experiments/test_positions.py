"""The positional-encoding study: end to end at a tiny size (files, schema, statistics over
seeds), its evaluation against a direct computation, and its config errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.data import DataConfig, get_batch, load_dataset
from jaxformer.experiments import positions as study
from jaxformer.experiments.report import markdown_table, row_title, summarize
from jaxformer.model.config import ConfigError
from jaxformer.positions.schemes import POSITION_SCHEMES
from tests.conftest import REPO
from tests.experiments.test_length_gen import assert_each_seed_trained_alone, separate_runs

ROWS = ["rope", "rope+yarn", "learned", "alibi"]  # notebook 2 runs all five schemes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text whose statistics a tiny model can learn in a few dozen steps."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x", "y"]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 9))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def study_run(corpus, tmp_path_factory):
    """The study through its command line: --small, two seeds, the schemes whose rows the
    study treats differently (RoPE and its eval-time scaling, learned) and ALiBi."""
    tmp = tmp_path_factory.mktemp("study")
    code = study.main(["--small", "--seeds", "2", "--out", str(tmp / "out"),
                       f"data.path={corpus}", f"data.cache_dir={tmp / 'cache'}",
                       "study.schemes=rope,learned,alibi", "--eval-lengths", "L,2L,4L",
                       "train.steps=40", "train.log_every=20", "study.progress=false"])
    assert code == 0
    return tmp / "out", json.loads((tmp / "out" / "results.json").read_text())


def test_study_writes_every_output(study_run):
    out, results = study_run
    assert (out / "positions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["train_len"] == 16 and results["eval_lengths"] == [16, 32, 64]
    assert results["eval_tokens"] == 2048 - 2048 % 64 and results["seeds"] == [0, 1]
    assert list(results["rows"]) == ROWS
    table = (out / "results.md").read_text()
    assert table == markdown_table(results)
    for name, row in results["rows"].items():
        assert len(row["ppl"]) == 2 and all(len(p) == 3 for p in row["ppl"])
        values = [p for per_seed in row["ppl"] for p in per_seed]
        if name == "learned":  # a table of L rows: nothing beyond L
            assert all(p[1:] == [None, None] for p in row["ppl"])
            assert row["mean"][1:] == [None, None] and row["std"][1:] == [None, None]
            values = [p[0] for p in row["ppl"]]
        # finite, above 1, and below chance (256 bytes): every model learned something
        assert all(np.isfinite(v) and 1 < v < 256 for v in values), (name, values)
        line = next(line for line in table.splitlines()
                    if line.startswith(f"| {row_title(name, row)} |"))
        assert line.count("n/a") == (3 if name == "learned" else 0)  # 2 lengths + the ratio
    assert results["rows"]["learned"]["params"] == results["rows"]["rope"]["params"] + 16 * 32


def test_seeds_report_mean_and_sample_std(study_run):
    out, results = study_run
    table = (out / "results.md").read_text()
    for name, row in results["rows"].items():
        for i, column in enumerate(zip(*row["ppl"])):
            if None in column:
                continue
            assert row["mean"][i] == pytest.approx(np.mean(column), rel=1e-12)
            assert row["std"][i] == pytest.approx(np.std(column, ddof=1), rel=1e-12)
            assert row["std"][i] > 0  # the seeds trained different models
            assert f"{row['mean'][i]:.2f} ± {row['std'][i]:.2f}" in table
        if "train_loss" in row:
            assert row["train_loss_mean"] == pytest.approx(np.mean(row["train_loss"]))


def test_rope_scaling_applies_only_beyond_the_training_length(study_run):
    rows = study_run[1]["rows"]
    for rope, yarn in zip(rows["rope"]["ppl"], rows["rope+yarn"]["ppl"]):
        assert yarn[0] == rope[0]  # factor 1: the same model
        assert yarn[1] != rope[1] and yarn[2] != rope[2]


def test_summarize_and_table_from_known_numbers():
    results = summarize({
        "train_len": 8, "eval_multiples": [1, 2], "eval_lengths": [8, 16], "eval_tokens": 64,
        "seeds": [0, 1, 2], "data": "x", "seconds": 1.0,
        "rows": {"alibi": {"scheme": "alibi", "scaling": None, "params": 10,
                           "ppl": [[2.0, 4.0], [3.0, 5.0], [4.0, 9.0]],
                           "train_loss": [1.0, 2.0, 3.0], "train_seconds": [1, 1, 1]},
                 "learned": {"scheme": "learned", "scaling": None, "params": 12,
                             "ppl": [[5.0, None], [6.0, None], [7.0, None]],
                             "train_loss": [1.0, 1.0, 1.0], "train_seconds": [1, 1, 1]}}})
    alibi, learned = results["rows"]["alibi"], results["rows"]["learned"]
    assert alibi["mean"] == [3.0, 6.0] and alibi["std"] == pytest.approx([1.0, np.sqrt(7.0)])
    assert learned["mean"] == [6.0, None] and learned["std"] == [1.0, None]
    table = markdown_table(results)
    assert "| alibi | 10 | 2.000 | **3.00 ± 1.00** | **6.00 ± 2.65** | 2.00 |" in table  # best
    assert "| learned | 12 | 1.000 | 6.00 ± 1.00 | n/a | n/a |" in table


def test_perplexity_is_the_mean_over_windows_of_each_length():
    """Windows of `length`, batched with a padded last batch, give exp(mean NLL) exactly as
    one forward per window does."""
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, position="alibi")
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    tokens = np.random.default_rng(0).integers(0, 256, 5 * 8 + 1)
    windows = jnp.asarray(np.stack([tokens[w * 8:(w + 1) * 8 + 1] for w in range(5)]))
    logits = jax.jit(model.apply)({"params": params}, windows[:, :-1])  # 5 windows at once
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
    expected = float(np.exp(np.mean(nll)))
    got = study.perplexity(cfg, params, tokens, 8, batch_tokens=16)  # 2 windows a batch
    assert got == pytest.approx(expected, rel=1e-5)
    assert study.perplexity(cfg, params, tokens, 40, batch_tokens=16) != pytest.approx(got)


@pytest.mark.parametrize("position", ["t5", "fire"])
def test_long_windows_are_scored_blockwise_as_dense(position, monkeypatch, capsys):
    """Past the dense budget (made small here) auto scores a window with blockwise
    attention, the bias a block at a time, and the perplexity is the reference backend's."""
    from jaxformer.attention import backends, blockwise
    from jaxformer.attention import rules as backend_rules
    monkeypatch.setattr(backends, "_EXPLAINED", set())
    monkeypatch.setattr(backend_rules, "DENSE_LOGITS_BYTES", 4 * 2 * 2 * 40 * 40 - 1)
    monkeypatch.setattr(blockwise, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise, "BLOCK_K", 8)
    cfg = ModelConfig(d_model=24, n_layers=2, n_heads=2, max_seq_len=64, position=position)
    params = Transformer(cfg).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 3.0, params)  # away from init's near-uniform output
    tokens = np.random.default_rng(0).integers(0, 256, 4 * 40 + 1)
    got = study.perplexity(cfg, params, tokens, 40, batch_tokens=80)
    assert "auto chose blockwise" in capsys.readouterr().err
    want = study.perplexity(cfg.replace(attention_impl="reference"), params, tokens, 40, 80)
    assert got == pytest.approx(want, rel=1e-5)
    assert study.perplexity(cfg, params, tokens, 20, 80) != pytest.approx(got, rel=1e-3)


def test_eval_lengths_flag_takes_multiples_of_l(capsys):
    from jaxformer.experiments.positions_config import multiples_of_l
    assert multiples_of_l("L,2L, 4L,32L") == "study.eval_multiples=1,2,4,32"
    for bad in ("1,2,4", "L,0L", "L,2x"):
        with pytest.raises(ValueError, match="multiples of the training length L"):
            multiples_of_l(bad)
    with pytest.raises(SystemExit):
        study.main(["--eval-lengths", "64,128"])
    assert "--eval-lengths 64,128: give multiples of the training length L" in \
        capsys.readouterr().err


def test_eval_config_scales_rope_by_the_length_multiple():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, position="rope")
    assert study.eval_config(cfg, None, 4, 16) is cfg
    assert study.eval_config(cfg, "yarn", 1, 16) is cfg
    scaled = study.eval_config(cfg, "yarn", 4, 16).rope_scaling
    assert (scaled.kind, scaled.factor, scaled.original_max_seq_len) == ("yarn", 4.0, 16)


@pytest.mark.parametrize("name", ["positions", "gpu"])
def test_shipped_configs_load(name):
    cfg = study.load_study_config(str(REPO / f"configs/experiments/{name}.yaml"))
    assert set(cfg.study.schemes) == set(POSITION_SCHEMES)  # every scheme
    assert [n // cfg.run.train.seq_len for n in cfg.eval_lengths] == [1, 2, 4, 8, 16, 32]
    assert cfg.model_config("learned").max_seq_len == cfg.run.train.seq_len
    assert cfg.model_config("alibi").max_seq_len == 32 * cfg.run.train.seq_len
    assert cfg.eval_tokens > 0 and cfg.eval_tokens % (8 * cfg.run.train.seq_len) == 0


@pytest.mark.parametrize("overrides, words", [
    (["study.schemez=rope"], ["study.schemez", "valid study keys", "schemes"]),
    (["study.schemes=rope,rotary"], ["study.schemes='rotary'", "alibi", "sinusoidal"]),
    (["study.schemes=rope,rope"], ["study.schemes", "twice"]),
    (["study.rope_scaling=stretch"], ["study.rope_scaling='stretch'", "yarn", "ntk"]),
    (["study.eval_multiples=1,4,2"], ["study.eval_multiples", "increase"]),
    (["study.eval_multiples=1,x"], ["study.eval_multiples='x'", "int"]),
    (["study.seeds=0"], ["study.seeds=0", ">= 1"]),
    (["study.eval_tokens=100"], ["study.eval_tokens=100", "2048"]),
    (["checkpoint.every=5"], ["checkpoint", "study, model, data, optim, train"]),
    (["model.position=alibi"], ["model.position", "study.schemes"]),
    (["model.rope_scaling.kind=yarn"], ["model.rope_scaling", "study.rope_scaling"]),
    (["model.max_seq_len=512"], ["model.max_seq_len", "train.seq_len"]),
    (["model.d_modle=64"], ["model.d_modle", "d_model"]),
    (["train.run_dir=x"], ["train.run_dir", "steps, batch_size, seq_len, seed, log_every"]),
    (["train.steps=many"], ["train.steps='many'", "int"]),
    (["data.pack=true"], ["data.pack"]),
    (["model.d_model=63"], ["d_model=63"]),
    (["steps=3"], ["section.field"]),
])
def test_config_errors_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        study.load_study_config(str(study.DEFAULT_CONFIG), overrides)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_command_line_reports_config_errors(capsys):
    assert study.main(["study.schemes=rotary", "--seeds", "2"]) == 2
    assert "error: study.schemes='rotary' is not one of" in capsys.readouterr().err
    assert study.main(["--seeds", "0"]) == 2
    assert "study.seeds=0" in capsys.readouterr().err


def test_near_best_marks_differences_within_the_seed_spread(rng):
    """Within one std (the larger of the two) of the best is 'near'; beyond it is not."""
    from jaxformer.experiments.report import near_best
    base, spread = float(rng.uniform(1, 10)), float(rng.uniform(0.1, 1))
    stats = {"best": (base, spread), "near": (base + 0.9 * spread, spread / 2),
             "far": (base + 1.1 * spread, spread / 2), "none": (None, None)}
    assert near_best(stats, lower_is_better=True) == {"best", "near"}
    flipped = {k: (None if m is None else -m, s) for k, (m, s) in stats.items()}
    assert near_best(flipped) == {"best", "near"}
    one_seed = {k: (m, None) for k, (m, _) in stats.items()}
    assert near_best(one_seed, lower_is_better=True) == {"best"}


def tiny_study(corpus, tmp_path, seed: int):
    """--small at one scheme scored at L only, 4 steps logged every 2 (the reported loss is
    the mean of steps 3 and 4), seeds train.seed = `seed` and seed + 1; and its data."""
    cfg = study.load_study_config(str(study.DEFAULT_CONFIG), [
        *study.SMALL, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
        "study.schemes=alibi", "study.eval_multiples=1", "train.steps=4", "train.log_every=2",
        "study.seeds=2", f"train.seed={seed}", "study.progress=false"])
    ds = load_dataset(cfg.run.data, vocab_size=cfg.run.model.vocab_size, progress=False,
                      log=lambda *a: None)
    t = cfg.run.train

    def batch(seed, step):  # the batch the study documents for a seed, drawn here
        return get_batch(ds.train, None, seed=seed, step=step, batch_size=t.batch_size,
                         seq_len=t.seq_len)

    return cfg, ds, batch


def test_study_reports_each_seeds_mean_loss_over_the_last_log_interval(corpus, tmp_path, rng):
    """rows[scheme]["train_loss"][i] is seed i's loss averaged over the steps of the last
    log interval (3 and 4), as the plain train step gives it for that seed alone on its
    own batches."""
    seed = int(rng.integers(1000))
    cfg, _, batch = tiny_study(corpus, tmp_path, seed)
    results = study.run_study(cfg)
    assert results["seeds"] == [seed, seed + 1]
    runs = separate_runs(cfg.model_config("alibi"), cfg.run.optim, cfg.run.train.steps,
                         results["seeds"], batch)
    want = [np.mean(losses[2:]) for _, losses in runs]
    row = results["rows"]["alibi"]
    # vmapped and alone agree to ~1e-7; the seeds differ by ~1e-2
    np.testing.assert_allclose(row["train_loss"], want, rtol=1e-5)
    assert row["train_loss_mean"] == pytest.approx(np.mean(want), rel=1e-5)


def test_each_vmapped_seed_trains_on_its_own_batches(corpus, tmp_path, rng):
    """Seed i of the study's vmapped training (train.seed first) has the params of seed i
    trained alone on seed i's batches, which differ from the other seed's."""
    seed = int(rng.integers(1000))
    cfg, ds, batch = tiny_study(corpus, tmp_path, seed)
    seeds = [seed, seed + 1]
    assert not np.array_equal(batch(seeds[0], 0)["inputs"], batch(seeds[1], 0)["inputs"])
    params, _ = study.train_models(cfg, cfg.model_config("alibi"), ds.train, seeds,
                                   log=lambda *a: None)
    runs = separate_runs(cfg.model_config("alibi"), cfg.run.optim, cfg.run.train.steps, seeds,
                         batch)
    assert_each_seed_trained_alone(params, runs)


def test_the_study_compares_schemes_in_an_encoder(corpus, tmp_path):
    """model.arch=encoder with objective.name=mlm: each scheme trains on masked tokens and is
    scored by the masked tokens' perplexity at every length (well below the 256 of a
    uniform guess after a few dozen steps: the objective is the one trained); a causal-only
    scheme is refused in one line before anything trains."""
    args = [*study.SMALL, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
            "model.arch=encoder", "objective.name=mlm", "study.eval_multiples=1,2",
            "train.steps=20", "train.log_every=20", "optim.lr=1e-2", "study.progress=false"]
    cfg = study.load_study_config(str(study.DEFAULT_CONFIG), [*args, "study.schemes=none,alibi"])
    results = study.run_study(cfg)
    assert results["config"]["objective"]["name"] == "mlm"
    for scheme in ("none", "alibi"):
        ppl = results["rows"][scheme]["ppl"][0]
        assert all(np.isfinite(p) and 1 < p < 64 for p in ppl), (scheme, ppl)
    with pytest.raises(ConfigError, match="position='xpos' is defined for causal attention"):
        study.load_study_config(str(study.DEFAULT_CONFIG), [*args, "study.schemes=rope,xpos"])


def test_an_encoders_perplexity_is_its_masked_tokens():
    """study.perplexity with the MLM objective: exp of the mean float64 cross entropy of
    the masked tokens of each window, corrupted as MLM's evaluation does (its fixed key
    folded with the batch's token sum)."""
    from jaxformer.training.mlm import MaskedLM, corrupt
    from tests.training.test_mlm import np_masked_loss
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    mcfg = ModelConfig(arch="encoder", d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                       position="alibi")  # 4 heads: the float64 forward's ALiBi slopes
    tokens = rng.integers(0, 255, 3 * 16 + 1)
    params = Transformer(mcfg).init(jax.random.key(int(rng.integers(1 << 30))),
                                    jnp.zeros((1, 16), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    got = study.perplexity(mcfg, params, tokens, 16, 32, objective=MaskedLM(0.3, 255, 256))
    windows = np.concatenate([tokens[:-1].reshape(3, 16), np.zeros((1, 16), int)])
    seg = np.repeat([1, 1, 1, 0], 16).reshape(4, 16)  # batches of 2 rows: the last padded
    pos = np.broadcast_to(np.arange(16), (2, 16))
    total = count = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        key = jax.random.fold_in(jax.random.PRNGKey(0x6D6C6D), int(windows[rows].sum()))
        corrupted, chosen = (np.asarray(x) for x in corrupt(
            key, jnp.asarray(windows[rows], jnp.int32), jnp.asarray(seg[rows] > 0), rate=0.3,
            mask_id=255, vocab_size=256))
        loss = np_masked_loss(mcfg, params, windows[rows], corrupted, chosen, pos, seg[rows])
        total, count = total + loss * chosen.sum(), count + chosen.sum()
    np.testing.assert_allclose(got, np.exp(total / count), rtol=1e-4)


def test_an_encoder_study_never_masks_its_tokenizers_end_of_text(corpus, tmp_path,
                                                                 monkeypatch):
    """The study trains and scores an encoder with the MLM objective of its data's
    tokenizer: a BPE's <|endoftext|> (the document separator) is never masked, as in a run."""
    seen = []

    def train_seeds(*args, objective=None, **kwargs):  # stop at the first scheme's training
        seen.append(objective)
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "train_seeds", train_seeds)
    bpe = load_dataset(DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"),
                                  tokenizer="bpe", bpe_vocab_size=300),
                       run_dir=str(tmp_path / "bpe"), vocab_size=300).tokenizer
    args = [*study.SMALL, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
            f"data.tokenizer={tmp_path / 'bpe' / 'tokenizer.json'}", "model.vocab_size=300",
            "model.arch=encoder", "objective.name=mlm", "study.schemes=alibi",
            "study.eval_tokens=512", "study.progress=false"]
    with pytest.raises(KeyboardInterrupt):
        study.run_study(study.load_study_config(str(study.DEFAULT_CONFIG), args))
    assert bpe.eot_id is not None and seen[0].eot_id == bpe.eot_id
