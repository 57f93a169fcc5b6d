"""The objective section (jaxformer.training.objectives): objective.name picks the entry
whose settings class takes the other keys; a key of another objective is refused in one
line naming the objectives that take it, unless it holds their default (what a saved
run's config.yaml, written when one flat class held every objective's keys, holds); each
entry's declarations (jaxformer.training.objectives.entry: settings, model archs, data
formats, metrics) are what the run
config and the loop act on. The entries are parametrised over the table: lm
(jaxformer.training.objectives.language_model), mlm (jaxformer.training.objectives.masked_lm),
dpo (jaxformer.training.objectives.preference), grpo
(jaxformer.training.objectives.group_policy) and any added later."""

import dataclasses

import numpy as np
import pytest
import yaml

from jaxformer import ModelConfig
from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, objectives
from jaxformer.training.config import RunConfig
from jaxformer.data.formats import FORMATS

rng = np.random.default_rng()

# the objective section every run dir written before the objectives owned their settings
# holds: the flat ObjectiveConfig's every field, its defaults for the objectives not run
OLD_DUMP = {"name": "lm", "beta": 0.1, "loss": "sigmoid", "group_size": 8, "temperature": 1.0,
            "max_new_tokens": 16, "reward": None, "inner_steps": 1, "clip": 0.2,
            "clip_high": None, "mask_rate": 0.15, "mask_id": None}
# what each objective needs beside the defaults to make a RunConfig
NEEDS = {"lm": [], "mlm": ["model.arch=encoder"],
         "dpo": ["data.format=preference", "data.path=p.jsonl", "train.init_from={run}"],
         "grpo": ["data.format=prompt_completion", "data.path=p.jsonl", "train.init_from={run}",
                  "objective.reward=task:copy"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir holding only its config: all train.init_from reads before the data."""
    run = tmp_path_factory.mktemp("sft")
    model = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": model.to_dict()}))
    return run


def needs(name, run):
    """NEEDS[name] (with `run` its train.init_from), or for an objective added later, the
    keys of the first entry of NEEDS training the same model and batches."""
    if name not in NEEDS:
        entry = objectives.OBJECTIVES[name]
        like = next(n for n in NEEDS if objectives.OBJECTIVES[n].batches == entry.batches)
        return [a for a in needs(like, run) if not a.startswith("objective.") and (
            entry.starts_from or not a.startswith("train.init_from"))]
    return [a.format(run=run) for a in NEEDS[name]]


def old_run_dir(tmp_path, objective):
    """A run dir's config.yaml as written before: every section whole, the objective flat."""
    values = RunConfig().to_dict()
    values["objective"] = objective
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def test_an_old_full_dump_loads_as_the_objective_it_ran(tmp_path, run):
    """Every key of the old flat section at its default, the name lm: the LM's settings,
    written back with the name alone; a DPO run's and an MLM run's keep their own values
    (random ones), the other objectives' keys at their defaults dropped."""
    cfg = load_config(str(old_run_dir(tmp_path, OLD_DUMP)))
    assert cfg.objective == objectives.settings("lm") and cfg.to_dict()["objective"] == {
        "name": "lm"}
    beta, rate, mask = float(rng.uniform(0.01, 2)), float(rng.uniform(0.01, 0.99)), \
        int(rng.integers(0, 255))
    dpo = {**OLD_DUMP, "name": "dpo", "beta": beta, "loss": "ipo"}
    cfg = load_config(str(old_run_dir(tmp_path, dpo)), needs("dpo", run))
    assert dataclasses.asdict(cfg.objective) == {"name": "dpo", "beta": beta, "loss": "ipo"}
    mlm = {**OLD_DUMP, "name": "mlm", "mask_rate": rate, "mask_id": mask}
    cfg = load_config(str(old_run_dir(tmp_path, mlm)), needs("mlm", run))
    assert dataclasses.asdict(cfg.objective) == {"name": "mlm", "mask_rate": rate,
                                                 "mask_id": mask}
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("key", sorted(set(OLD_DUMP) - {"name"}))
def test_another_objectives_key_off_its_default_is_refused_in_one_line(key, run):
    """objective.KEY=VALUE with an objective that does not take KEY: a value other than
    the takers' default is refused, naming them; their default passes (old dumps)."""
    takers = objectives.owners(key)
    others = [n for n in objectives.OBJECTIVES if n not in takers and n in NEEDS]
    name = others[int(rng.integers(len(others)))]
    other = {"beta": "0.5", "loss": "ipo", "group_size": "3", "temperature": "0.7",
             "max_new_tokens": "5", "reward": "task:copy", "inner_steps": "2", "clip": "0.3",
             "clip_high": "0.4", "mask_rate": "0.2", "mask_id": "7"}[key]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*needs(name, run), f"objective.name={name}",
                               f"objective.{key}={other}"])
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"objective.{key}={other} is not a setting of objective.name={name}"), message
    assert message.endswith(f"{key} is taken by objective.name {', '.join(takers)}"), message
    default = "none" if OLD_DUMP[key] is None else str(OLD_DUMP[key])
    cfg = load_config(None, [*needs(name, run), f"objective.name={name}",
                             f"objective.{key}={default}"])
    assert key not in dataclasses.asdict(cfg.objective)


def test_mask_rate_with_lm_names_mlm():
    with pytest.raises(ConfigError, match=r"^objective.mask_rate=0.2 is not a setting of "
                       r"objective.name=lm; mask_rate is taken by objective.name mlm$"):
        load_config(None, ["objective.mask_rate=0.2"])


def test_an_unknown_key_and_name_are_refused_in_one_line(run):
    with pytest.raises(ConfigError, match=r"^unknown key objective.bogus; objective.name=dpo "
                       r"takes name, beta, loss$"):
        load_config(None, [*needs("dpo", run), "objective.name=dpo", "objective.bogus=1"])
    with pytest.raises(ConfigError, match=r"objective.name='nope' is not one of "
                       + ", ".join(objectives.OBJECTIVES)):
        load_config(None, ["objective.name=nope"])


@pytest.mark.parametrize("name, spelling", [
    ("sft", "for SFT set objective.name=lm with data.format=prompt_completion"),
    ("IPO", "for IPO set objective.name=dpo objective.loss=ipo")])
def test_a_methods_name_that_is_not_an_objectives_says_how_to_spell_it(name, spelling):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"objective.name={name}"])
    assert str(e.value) == (f"objective.name={name!r} is not one of "
                            f"{', '.join(objectives.OBJECTIVES)}; {spelling}")


@pytest.mark.parametrize("name", sorted(objectives.OBJECTIVES))
def test_each_entry_owns_its_settings_and_round_trips(name, run):
    """Each entry's settings hold its name and its own keys alone; a RunConfig of it
    written out and read back is the same, and the entry builds its hooks before the
    data (tokenizer None) with the step's interface."""
    entry = objectives.OBJECTIVES[name]
    cfg = load_config(None, [*needs(name, run), f"objective.name={name}"] + (
        ["objective.reward=task:copy"] if "reward" in objectives.own_fields(entry) else []))
    assert type(cfg.objective) is entry.settings and cfg.objective.name == name == entry.name
    assert set(dataclasses.asdict(cfg.objective)) == {"name", *objectives.own_fields(entry)}
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    hooks = entry.build(cfg, None)
    wanted = ("rollout_step", "eval_sums") if entry.rollout else (
        "gradient_sums", "eval_sums", "metrics")
    assert all(callable(getattr(hooks, m, None)) for m in wanted), (name, hooks)
    assert objectives.has_perplexity(cfg) == entry.perplexity
    assert objectives.needs_reference(cfg) == entry.reference(cfg.objective)


@pytest.mark.parametrize("name", sorted(objectives.OBJECTIVES))
def test_the_entry_says_which_model_and_data_it_trains(name, run):
    """Every model.arch and data.format pair the entry does not declare is refused in one
    line naming the objective and the arch or the format; its declared ones are not (a
    post-training one then asks for its train.init_from, left out here: that run's model
    would override model.arch)."""
    entry = objectives.OBJECTIVES[name]
    base = [a for a in needs(name, run) if not a.startswith(
        ("model.arch", "data.format", "train.init_from"))]
    extra = ["objective.reward=task:copy"] if "reward" in objectives.own_fields(entry) else []
    for arch in ("decoder", "encoder", "encoder_decoder"):
        for fmt, batches in ((n, f.batch) for n, f in FORMATS.items()):
            args = [*base, *extra, f"objective.name={name}", f"model.arch={arch}",
                    f"data.format={fmt}", "data.path=p.jsonl"]
            declared = batches in entry.batches.get(arch, ())
            if declared and not entry.starts_from:
                assert load_config(None, args).objective.name == name
                continue
            with pytest.raises(ConfigError) as e:
                load_config(None, args)
            message = str(e.value)
            assert "\n" not in message and f"objective.name={name}" in message, message
            assert (f"objective.name={name} needs train.init_from" in message) == declared, \
                message
            assert declared or f"model.arch={arch}" in message or \
                f"data.format={fmt}" in message, message


def test_a_post_training_objective_needs_its_starting_weights(run):
    for name, entry in objectives.OBJECTIVES.items():
        args = [a for a in needs(name, run) if not a.startswith("train.init_from")]
        if entry.starts_from:
            with pytest.raises(ConfigError, match=f"objective.name={name} needs "
                               "train.init_from"):
                load_config(None, [*args, f"objective.name={name}"])


@pytest.mark.parametrize("name,extra,needle", [
    ("dpo", ["model.lora.sweep_rank=2,4"], "drop model.lora.sweep_*, the MoE layers, or"),
    ("grpo", ["optim.grad_accum=2", "train.batch_size=4"],
     "and optim.grad_accum=1; drop model.lora.sweep_*, the MoE layers and optim.grad_accum")])
def test_the_pair_and_rollout_objectives_train_a_dense_model(run, name, extra, needle):
    """A LoRA sweep (DPO) or gradient accumulation (GRPO) is refused in one line that
    names the objective."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [*needs(name, run), f"objective.name={name}", *extra])
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"objective.name={name} trains a dense model with one adapter or none"), message
    assert needle in message, message
