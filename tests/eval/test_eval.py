"""jaxformer.eval (the model class jaxformer.eval.lm, a run's weights read by
jaxformer.eval.loading, requests scored by jaxformer.eval.scoring) against
lm-evaluation-harness's own `hf` model on the same weights: a tiny
run trained for a few steps, exported with `python -m jaxformer.convert to-hf`, gives the
same per-example log-likelihoods, perplexities, greedy completions and accuracy."""

import json

import numpy as np
import pytest

from jaxformer.training import load_config, train
from tests.conftest import REPO

lm_eval = pytest.importorskip("lm_eval")
LM = pytest.importorskip("lm_eval.api.model").LM
pytest.importorskip("torch")

TASKS = REPO / "tests/eval/tasks"  # their data_files are relative to the repository root
NAMES = ["jaxformer_choice", "jaxformer_text", "jaxformer_complete"]
WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
RUN = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
       "model.vocab_size=320", "train.seq_len=32", "train.batch_size=4", "train.steps=60",
       "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
       "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(run dir, its to-hf export): a BPE run that learned to count in words (each line
    counts on from a random word, as the tasks' contexts do; the same text every run)."""
    from jaxformer.convert.__main__ import to_hf_run
    from jaxformer.data import train_bpe
    d = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[(s + i) % 12] for i in range(rng.integers(3, 9)))
             for s in rng.integers(0, 12, 3000)]
    (d / "corpus.txt").write_text("\n".join(lines))
    train_bpe(iter(lines), 320).save(d / "tok")
    cfg = load_config(str(REPO / "configs/tiny.yaml"),
                      [*RUN, f"data.path={d / 'corpus.txt'}", f"train.run_dir={d / 'run'}",
                       f"data.tokenizer={d / 'tok/tokenizer.json'}", f"data.cache_dir={d / 'c'}"])
    train(cfg, log=lambda *a: None)
    to_hf_run(str(d / "run"), str(d / "hf"), log=lambda *a: None)
    return d / "run", d / "hf"


def by_doc(samples):
    """{doc_id: the example's responses} of one task's logged samples."""
    return {s["doc_id"]: s["resps"] for s in samples}


def loglikelihoods(task, resps):
    """An example's log-likelihoods: choice's resps are [[(logp, is_greedy)] per choice],
    text's [[logp]]."""
    return np.array([r[0][0] if task == "jaxformer_choice" else r[0] for r in resps])


def test_a_run_scores_every_example_as_lm_evals_hf_model_scores_its_export(
        exported, tmp_path, monkeypatch):
    from jaxformer.eval.__main__ import main
    from lm_eval.tasks import TaskManager
    run, hf = exported
    monkeypatch.chdir(REPO)
    out = tmp_path / "results.json"
    assert main([str(run), "--tasks", ",".join(NAMES), "--include_path", str(TASKS),
                 "--limit", "20", "--batch_size", "8", "--output", str(out)]) == 0
    ours = json.loads(out.read_text())
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32",
                                     device="cpu", tasks=NAMES, limit=20, log_samples=True,
                                     task_manager=TaskManager(include_path=str(TASKS),
                                                              include_defaults=False))
    for task in NAMES:
        a, b = by_doc(ours["samples"][task]), by_doc(theirs["samples"][task])
        assert a.keys() == b.keys() and len(a) == (20 if task == "jaxformer_choice" else 6)
        for doc in a:
            if task == "jaxformer_complete":  # greedy text, until "\n"
                assert a[doc] == b[doc], (doc, a[doc], b[doc])
                continue
            np.testing.assert_allclose(loglikelihoods(task, a[doc]),
                                       loglikelihoods(task, b[doc]), rtol=0, atol=1e-4)
            if task == "jaxformer_choice":  # and whether greedy decoding gives the choice
                assert [x[0][1] for x in a[doc]] == [x[0][1] for x in b[doc]], doc
    for task, metric in [("jaxformer_choice", "acc,none"), ("jaxformer_complete",
                                                              "exact_match,none")]:
        assert ours["results"][task][metric] == theirs["results"][task][metric]
    # the model learned to count: better than the 1/3 of chance, and it completes lines
    assert ours["results"]["jaxformer_choice"]["acc,none"] > 0.5
    assert any(r[0][0].strip() for r in by_doc(ours["samples"]["jaxformer_complete"]).values())


def test_a_request_longer_than_max_seq_len_loses_its_left_end_as_in_lm_evals_hf(exported, rng):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from jaxformer.eval import JaxformerLM
    run, hf = exported
    ours, theirs = JaxformerLM(str(run), batch_size=4), HFLM(pretrained=str(hf),
                                                            dtype="float32", device="cpu")
    assert ours.max_length == theirs.max_length == 32
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(n, n + 6)))) for n in (40, 60, 3)]
    requests = [Instance("loglikelihood", {}, (t, " " + str(rng.choice(WORDS))), i)
                for i, t in enumerate(texts)]
    assert len(ours.tok_encode(texts[1])) > 32 + 1  # truncated
    mine = ours.loglikelihood(requests, disable_tqdm=True)
    ref = theirs.loglikelihood(requests, disable_tqdm=True)
    np.testing.assert_allclose([m[0] for m in mine], [r[0] for r in ref], rtol=0, atol=1e-4)
    assert [m[1] for m in mine] == [r[1] for r in ref]


def test_generate_until_keeps_a_long_contexts_last_tokens_as_lm_evals_hf(exported, rng):
    """Contexts longer than max_seq_len - max_gen_toks keep their last tokens (lm-eval's
    `hf` model left-truncates to that room): the greedy continuations are the `hf` model's
    of the export. The contexts are lines counting on from random words, the last one
    unfinished, so a context cut elsewhere ends on another word, from which the model
    (it learned to count) goes on."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from jaxformer.eval import JaxformerLM
    run, hf = exported
    ours, theirs = JaxformerLM(str(run), batch_size=4), HFLM(pretrained=str(hf),
                                                            dtype="float32", device="cpu")
    gen = int(rng.integers(4, 9))
    texts = ["\n".join(" ".join(WORDS[(s + i) % 12] for i in range(int(rng.integers(3, 9))))
                       for s in rng.integers(0, 12, 10)) for _ in range(6)]
    assert all(len(ours.tok_encode(t)) > 32 - gen for t in texts)  # each one truncated
    requests = [Instance("generate_until", {}, (t, {"until": ["zzz"], "max_gen_toks": gen}), i)
                for i, t in enumerate(texts)]
    mine = ours.generate_until(requests, disable_tqdm=True)
    assert mine == theirs.generate_until(requests, disable_tqdm=True)
    assert any(m.strip() for m in mine)  # the model goes on counting somewhere


def test_generate_until_through_the_engine_is_lm_evals_hf_greedy_text(exported, rng):
    """engine=true (the serving engine, 3 slots for two groups of 4 requests of mixed
    lengths, so a request is admitted as another ends): the same continuations as
    lm-eval's `hf` model on the export, and as the generate path; stop strings cut some."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from jaxformer.eval import JaxformerLM
    run, hf = exported
    ours = JaxformerLM(str(run), batch_size=3, engine="true")
    static, theirs = JaxformerLM(loaded=ours.loaded, batch_size=3), HFLM(
        pretrained=str(hf), dtype="float32", device="cpu")
    texts = [" ".join(WORDS[(s + i) % 12] for i in range(int(rng.integers(1, 12))))
             for s in rng.integers(0, 12, 8)]
    stops, gen = ["zzz", str(rng.choice(WORDS))], int(rng.integers(4, 9))
    requests = [Instance("generate_until", {}, (t, {"until": [stops[i % 2]], "max_gen_toks": gen}),
                         i) for i, t in enumerate(texts)]
    mine = ours.generate_until(requests, disable_tqdm=True)
    assert mine == theirs.generate_until(requests, disable_tqdm=True)
    assert mine == static.generate_until(requests, disable_tqdm=True)
    assert ours.engine.stats()["running"] == 0 and any(m.strip() for m in mine)


def test_matmul_precision_replaces_the_runs_own(exported, capsys):
    """matmul_precision=P (--matmul-precision) scores with the weight matmuls in P; an
    unknown name is refused naming the choices."""
    from jaxformer.eval import JaxformerLM
    from jaxformer.eval.__main__ import parse_args
    run, _ = exported
    lm = JaxformerLM(str(run), batch_size=2)
    assert lm.loaded.model.cfg.matmul_precision == "default"
    rowwise = JaxformerLM(loaded=lm.loaded, batch_size=2, matmul_precision="fp8_rowwise")
    assert rowwise.loaded.model.cfg.matmul_precision == "fp8_rowwise"
    for spelling in ("--matmul-precision", "--matmul_precision"):
        assert parse_args([str(run), "--tasks", "t", spelling, "int8"]).matmul_precision == \
            "int8"
    with pytest.raises(SystemExit):
        parse_args([str(run), "--tasks", "t", "--matmul-precision", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_an_unknown_run_dir_is_one_line_naming_what_it_wants(tmp_path, capsys, monkeypatch):
    from jaxformer.eval.__main__ import main
    assert main([str(tmp_path / "nothing"), "--tasks", "jaxformer_choice"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "neither a jaxformer run dir (with config.yaml) nor" in err
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # not installed
    assert main([str(tmp_path), "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == ("error: jaxformer.eval needs "
                                               "lm-evaluation-harness: pip install "
                                               "'jaxformer[eval]'")


@pytest.mark.parametrize("flags, says", [
    (["--limit", "0"], "--limit must be > 0 (a count, or a fraction below 1), got 0"),
    (["--limit", "-3"], "--limit must be > 0 (a count, or a fraction below 1), got -3"),
    (["--limit", "2.5"], "--limit must be > 0 (a count, or a fraction below 1), got 2.5"),
    (["--batch_size", "0"], "--batch_size must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch_size must be >= 1, got -1"),
    (["--num-fewshot", "-1"], "--num_fewshot must be >= 0, got -1"),
    (["--max_gen_toks", "0"], "--max_gen_toks must be >= 1, got 0"),
])
def test_a_flag_out_of_range_is_one_line_before_anything_loads(tmp_path, capsys, flags, says):
    from jaxformer.eval.__main__ import main, parse_args
    assert main([str(tmp_path), "--tasks", "jaxformer_choice", *flags]) == 2
    assert capsys.readouterr().err == f"error: {says}\n"
    for spelling in ("--batch_size", "--batch-size"):  # lm-eval's, and the hyphenated one
        assert parse_args(["m", "--tasks", "t", spelling, "3"]).batch_size == 3


class Unused(LM):
    """A model that is never asked anything: the run stops before any request."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def loglikelihood(self, requests):
        raise AssertionError("not reached")

    loglikelihood_rolling = generate_until = loglikelihood


def test_an_unknown_task_names_the_fix(tmp_path, capsys, monkeypatch):
    from lm_eval.tasks import TaskManager

    import jaxformer.eval.__main__ as cli
    monkeypatch.setattr("jaxformer.eval.lm.JaxformerLM", Unused)
    monkeypatch.setattr(cli, "task_manager", lambda path, names: TaskManager(
        include_path=path, include_defaults=False))  # lm-eval's own index takes ~20 s
    assert cli.main([str(tmp_path), "--tasks", "jaxformer_choice,nosuchtask",
                     "--include_path", str(TASKS)]) == 2
    assert capsys.readouterr().err == (
        "error: unknown task nosuchtask: not a registered lm-eval task, group or tag name, nor "
        "a task YAML file; check the name, or pass --include_path DIR for local task YAMLs\n")


def test_a_hub_task_offline_is_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    """A task whose dataset is on the Hub, with the Hub out of reach (datasets raises
    ConnectionError, as it does with no network and nothing cached)."""
    import datasets

    from jaxformer.eval.__main__ import main
    (tmp_path / "hellaswag.yaml").write_text(
        (TASKS / "jaxformer_choice.yaml").read_text().replace("task: jaxformer_choice",
                                                              "task: hellaswag")
        .replace("dataset_path: json", "dataset_path: Rowan/hellaswag"))

    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr("jaxformer.eval.lm.JaxformerLM", Unused)
    assert main([str(tmp_path), "--tasks", "hellaswag", "--include_path", str(tmp_path),
                 "--limit", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: --tasks hellaswag needs a dataset from the Hugging Face Hub, which cannot be "
        "reached (Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)); "
        "download it into the datasets cache first, or run local tasks with --include_path "
        "DIR\n")
