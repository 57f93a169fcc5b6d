"""Model variants as columns of the positional studies (jaxformer.experiments.positions_config
COLUMNS, MODEL_VARIANTS): the layers each builds from the run's model, the errors naming the
column, and the reports' records and notes of them (jaxformer.experiments.report,
jaxformer.experiments.length_gen_report)."""

import json

import numpy as np
import pytest

from jaxformer import ModelConfig
from jaxformer.experiments import length_gen
from jaxformer.experiments import positions as study
from jaxformer.experiments.length_gen_report import markdown
from jaxformer.experiments.positions_config import COLUMNS, MODEL_VARIANTS, column_model
from jaxformer.experiments.report import markdown_table, summarize
from jaxformer.model.config import ConfigError
from tests.conftest import REPO

GD, ATT = "gated_delta", "attention"


def test_each_column_builds_its_layers_from_the_runs_model(rng):
    """The hybrids repeat 3 gated DeltaNet layers : 1 attention layer over the run's layers;
    pure recurrent columns have no positions; each mixer's heads and widths follow the run's
    model; a scheme's column keeps the run's layers."""
    heads = int(rng.choice([2, 4]))
    base = ModelConfig(vocab_size=64, d_model=16 * heads, n_layers=8, n_heads=heads,
                       norm="rmsnorm", ffn="swiglu")
    expected = {"hybrid-rope": ("rope", [GD, GD, GD, ATT] * 2),
                "hybrid-nope": ("none", [GD, GD, GD, ATT] * 2),
                "hybrid-alibi": ("alibi", [GD, GD, GD, ATT] * 2),
                "hybrid-conv": ("rope", ["short_conv", "short_conv", ATT] * 2 + ["short_conv"] * 2),
                "gated_delta": ("none", [GD] * 8), "mamba2": ("none", ["mamba2"] * 8),
                "alibi": ("alibi", [ATT] * 8), "none": ("none", [ATT] * 8)}
    assert set(MODEL_VARIANTS) <= set(expected)
    for name, (position, mixers) in expected.items():
        m = column_model(name, base)
        assert (m.position, list(m.layer_mixers)) == (position, mixers), name
        assert (m.d_model, m.n_layers, m.ffn) == (base.d_model, 8, "swiglu")
    delta = column_model("hybrid-rope", base).mixer_settings(GD)
    assert (delta.heads, delta.key_dim, delta.value_dim) == (heads, 16, 16)
    ssm = column_model("mamba2", base).mixer_settings("mamba2")
    assert (ssm.heads, ssm.head_dim, ssm.state) == (heads, 32, 16)
    with pytest.raises(ConfigError, match=r"hybrid-rope: model.n_layers=2 .* raise model.n_layers"):
        column_model("hybrid-rope", base.replace(n_layers=2))


def test_both_studies_take_variants_as_columns():
    """study.schemes names variants beside schemes; an unknown name lists them."""
    cfg = study.load_study_config(None, ["model.n_layers=4", "study.schemes=rope,hybrid-nope"])
    assert cfg.model_config("hybrid-nope").layer_mixers == (GD, GD, GD, ATT)
    assert cfg.model_config("hybrid-nope").max_seq_len == 32 * cfg.run.train.seq_len
    lg = length_gen.load_config(None, ["model.n_layers=4", "study.schemes=mamba2"])
    assert lg.model_config("mamba2").layer_mixers == ("mamba2",) * 4
    with pytest.raises(ConfigError, match="study.schemes='hybrid' .*hybrid-rope.*mamba2"):
        study.load_study_config(None, ["study.schemes=hybrid"])
    with pytest.raises(ConfigError, match="hybrid-alibi: model.n_layers=2"):
        length_gen.load_config(None, ["model.n_layers=2", "study.schemes=rope,hybrid-alibi"])
    assert set(COLUMNS) >= {"rope", "learned", *MODEL_VARIANTS}


def test_reports_say_what_each_variant_is():
    """A variant's row names its layers and position in a note; rows of results written
    before variants (no position recorded) still give the learned table's note."""
    rows = {"hybrid-rope": {"scheme": "hybrid-rope", "scaling": None, "params": 9,
                            "position": "rope", "layers": "3 gated_delta, 1 attention",
                            "about": "3 : 1", "ppl": [[2.0]], "train_loss": [1.0],
                            "train_seconds": [1]},
            "learned": {"scheme": "learned", "scaling": None, "params": 9, "ppl": [[3.0]],
                        "train_loss": [1.0], "train_seconds": [1]}}
    table = markdown_table(summarize({"train_len": 8, "eval_multiples": [1], "eval_lengths": [8],
                                      "eval_tokens": 8, "seeds": [0], "data": "x",
                                      "seconds": 1.0, "rows": rows}))
    assert "- hybrid-rope: 3 : 1 (layers: 3 gated_delta, 1 attention; position=rope)" in table
    assert "learned: its position table has L rows" in table
    assert table.count("layers:") == 1
    results = {"tasks": ["copy"], "seeds": [0], "train_max_len": 2, "eval_lengths": [1, 3],
               "eval_examples": 4, "seconds": 1.0,
               "rows": {"mamba2": {"copy": {"accuracy": [[1.0, 0.5]], "mean": [1.0, 0.5],
                                            "std": [None, None]}}},
               "models": {"mamba2": {"position": "none", "layers": "4 mamba2", "about": "SSD"}}}
    assert "- mamba2: SSD (layers: 4 mamba2; position=none)" in markdown(results)
    del results["models"]
    assert "layers:" not in markdown(results)


def test_the_length_study_runs_a_hybrid_column(tmp_path):
    """End to end on LFM2's mix (short convolutions : attention): the results record the
    column's position and layers, and a model trained 2 steps scores within [0, 1]."""
    out = tmp_path / "lg"
    assert length_gen.main(["--small", "model.n_layers=3", "study.schemes=hybrid-conv",
                            "study.tasks=copy", "train.steps=2", "study.eval_lengths=1,4",
                            "study.eval_examples=4", "study.progress=false",
                            "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["models"]["hybrid-conv"] == {
        "position": "rope", "layers": "2 short_conv, 1 attention",
        "about": MODEL_VARIANTS["hybrid-conv"].about}
    acc = np.asarray(results["rows"]["hybrid-conv"]["copy"]["accuracy"])
    assert acc.shape == (1, 2) and ((0 <= acc) & (acc <= 1)).all()
    assert "hybrid-conv: 2 gated short convolutions" in (out / "results.md").read_text()


def test_shipped_hybrid_configs_load():
    """configs/experiments/hybrids*.yaml: pure attention beside the hybrids and the pure
    recurrent models, with layers enough for one repeat of the hybrids' pattern."""
    ppl = study.load_study_config(str(REPO / "configs/experiments/hybrids.yaml"))
    lg = length_gen.load_config(str(REPO / "configs/experiments/hybrids_length_gen.yaml"))
    for cfg in (ppl, lg):
        assert {"rope", "hybrid-rope", "hybrid-nope", "gated_delta", "mamba2"} <= \
            set(cfg.study.schemes) and cfg.study.seeds == 3
        assert cfg.model_config("hybrid-alibi").layer_mixers == (GD, GD, GD, ATT)
