"""objective.name=orpo (jaxformer.training.objectives.odds_ratio) on data.format=preference
pairs: the loss against the paper's formula in float64 NumPy, on random log-probs and on a
model's packed pairs, and a run from scratch that learns the chosen answers."""

import jax
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.data import DataConfig, load_dataset
from jaxformer.training import load_config, objectives, train
from jaxformer.training.metrics import read_metrics
from jaxformer.training.objectives.odds_ratio import METRICS, odds_ratio_terms
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_eval_step, make_train_step
from tests.training import test_dpo
from tests.training.test_dpo import RUN, answer_logp, sums, write_jsonl

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


@pytest.fixture(autouse=True)
def dpo_draws(rng, monkeypatch):
    """test_dpo's helpers (its preference records) draw from this test's seeded rng."""
    monkeypatch.setattr(test_dpo, "rng", rng)


def numpy_orpo(chosen, rejected, n_chosen, n_rejected, lam):
    """Hong et al.'s loss per pair and its logged terms, in float64: P(y) the answer's
    per-token geometric mean probability, odds(y) = P / (1 - P)."""
    p_w, p_l = np.exp(chosen / n_chosen), np.exp(rejected / n_rejected)
    ratio = np.log((p_w / (1 - p_w)) / (p_l / (1 - p_l)))
    l_or = -np.log(1 / (1 + np.exp(-ratio)))
    return -np.log(p_w) + lam * l_or, {"nll_chosen": -np.log(p_w), "log_odds_ratio": ratio,
                                       "odds_ratio_loss": l_or,
                                       "odds_accuracy": (ratio > 0).astype(np.float64)}


def test_the_loss_is_the_papers_formula_on_random_log_probs():
    n = 64
    tokens = rng.integers(1, 20, (2, n)).astype(np.float64)
    mean = rng.uniform(-4.0, -0.01, (2, n))  # per-token mean log-probs
    lam = float(rng.uniform(0.05, 2.0))
    summed = (mean * tokens).astype(np.float32)
    got, got_m = odds_ratio_terms(summed[0], summed[1], tokens[0].astype(np.float32),
                                  tokens[1].astype(np.float32), lam)
    want, want_m = numpy_orpo(summed[0].astype(np.float64), summed[1].astype(np.float64),
                              tokens[0], tokens[1], lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for k in METRICS:
        np.testing.assert_allclose(np.asarray(got_m[k]), want_m[k], rtol=1e-5, atol=1e-5,
                                   err_msg=k)


def numpy_pairs(model, params, batch):
    """Each pair's (chosen, rejected) summed answer log-probs and answer lengths, read
    back from the packed rows (segment 2k - 1 chosen, 2k rejected) and run one at a time."""
    run = jax.jit(lambda p, x: model.apply({"params": p}, x))
    out = []
    for r in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][r]
        for k in range(1, int(seg.max()) // 2 + 1):
            row = []
            for s in (2 * k - 1, 2 * k):
                at = seg == s
                ids = np.concatenate([batch["inputs"][r][at], batch["targets"][r][at][-1:]])
                prompt_len = bytes(ids.tolist()).decode().index("=") + 1
                row += [answer_logp(run, params, ids, prompt_len), len(ids) - prompt_len]
            out.append(row)
    return np.asarray(out, np.float64).T  # chosen, n chosen, rejected, n rejected


def test_the_steps_loss_is_the_papers_formula_on_a_models_pairs(tmp_path):
    """A packed batch of pairs: the eval step's and the train step's loss and metrics
    equal NumPy's from each answer's log-probs computed alone, with model.loss_chunk=7 (the
    log-probs through the head 7 positions at a time; test_dpo.py: the whole logits')."""
    path = write_jsonl(tmp_path / "p.jsonl", sums(30, lambda a, b: int(rng.integers(10, 200))))
    data = load_dataset(DataConfig(path=str(path), format="preference", val_fraction=0.0,
                                   cache_dir=str(tmp_path / "c")), run_dir=str(tmp_path / "run"),
                        vocab_size=256, progress=False, log=lambda *a: None)
    batch = data.train_batch(seed=int(rng.integers(1 << 30)), step=0, batch_size=3, seq_len=24)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=24,
                      position="learned")  # absolute: positions must restart per answer
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), batch["inputs"][:1])["params"]
    lam = float(rng.uniform(0.05, 2.0))
    objective = objectives.OBJECTIVES["orpo"].build(
        load_config(None, ["objective.name=orpo", f"objective.beta={lam}", "model.arch=decoder",
                           "data.format=preference", f"data.path={path}",
                           "model.loss_chunk=7"]), None)
    assert objective.chunk == 7
    c, nc, r, nr = numpy_pairs(model, params, batch)
    losses, metrics = numpy_orpo(c, r, nc, nr, lam)
    total, count, got = make_eval_step(model, objective=objective)(params, batch)
    assert int(count) == len(c)
    np.testing.assert_allclose(float(total) / len(c), losses.mean(), rtol=2e-5, atol=1e-6)
    for k in METRICS:
        np.testing.assert_allclose(float(got[k]) / len(c), metrics[k].mean(), rtol=2e-5,
                                   atol=1e-6, err_msg=k)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 10)
    state = init_state(model, tx, 0).replace(params=params)
    _, m = make_train_step(model, tx, schedule, objective=objective)(state, batch)
    np.testing.assert_allclose(float(m["loss"]), losses.mean(), rtol=2e-5, atol=1e-6)
    for k in METRICS:
        np.testing.assert_allclose(float(m[k]), metrics[k].mean(), rtol=2e-5, atol=1e-6,
                                   err_msg=k)


def test_an_orpo_run_learns_the_chosen_answers_from_scratch(tmp_path):
    """No SFT run and no reference: from random weights the chosen answers' NLL falls and
    their odds rise above the rejected ones', on the train pairs and the held-out ones;
    the evaluation logs the held-out pairs' terms and no perplexity."""
    write_jsonl(tmp_path / "pairs.jsonl", sums(400))
    lines = []
    # lr 5e-3: at 1e-2 one draw of the pairs in about 25 kept the answers' marginal (NLL
    # 2.0, odds accuracy 0.77) to the end; at 5e-3 the worst of 63 draws ended at 0.95
    summary = train(load_config(None, [
        *RUN, f"data.cache_dir={tmp_path / 'c'}", f"data.path={tmp_path / 'pairs.jsonl'}",
        "data.format=preference", "objective.name=orpo", "objective.beta=0.5",
        "train.steps=80", "train.eval_every=40", "optim.lr=5e-3", "optim.schedule=constant",
        f"train.run_dir={tmp_path / 'orpo'}"]), log=lambda *a: lines.append(" ".join(a)))
    steps = [r for r in read_metrics(tmp_path / "orpo") if "odds_accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 81))
    late = steps[-5:]
    assert np.mean([r["nll_chosen"] for r in late]) < steps[0]["nll_chosen"] - 2.5
    assert np.mean([r["odds_accuracy"] for r in late]) > 0.85
    assert np.mean([r["log_odds_ratio"] for r in late]) > 1.5
    assert summary["val_odds_accuracy"] > 0.8 and summary["val_log_odds_ratio"] > 1.5
    assert "val_ppl" not in summary and not any("val_ppl" in x for x in lines)
