"""Run config loading, overrides and errors; the optimizer's schedules and decay mask."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.model.config import ConfigError
from jaxformer.training import load_config
from jaxformer.training.config import RunConfig, parse_overrides
from jaxformer.training.optim import OptimConfig, decay_mask, learning_rate_schedule, make_optimizer
from tests.conftest import REPO, np_global_norm


def test_tiny_yaml_loads_with_overrides():
    cfg = load_config(str(REPO / "configs/tiny.yaml"),
                      ["train.steps=7", "optim.lr=3e-4", "model.n_layers=2",
                       "model.rope_scaling.kind=linear", "model.rope_scaling.factor=2",
                       "data.pack=true", "model.sliding_window=none", "mesh.data=-1"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4 and cfg.model.n_layers == 2
    assert cfg.model.rope_scaling.kind == "linear" and cfg.model.rope_scaling.factor == 2.0
    assert cfg.data.pack is True and cfg.model.sliding_window is None and cfg.mesh.data == -1
    assert cfg.model.d_model == ModelConfig.preset("tiny").d_model  # from the preset
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    cfg = load_config(str(path))
    assert isinstance(cfg.model, ModelConfig)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_preset_with_override_keys():
    cfg = RunConfig.from_dict({"model": {"preset": "gpt2-small", "n_layers": 2}})
    assert cfg.model.n_layers == 2 and cfg.model.vocab_size == 50257


@pytest.mark.parametrize("overrides, words", [
    (["train.stepz=3"], ["train.stepz", "valid train keys", "steps"]),
    (["trian.steps=3"], ["trian.steps", "model", "train", "optim"]),
    (["train.steps=abc"], ["train.steps='abc'", "int"]),
    (["optim.lr=fast"], ["optim.lr='fast'", "number"]),
    (["optim.schedule=step"], ["optim.schedule='step'", "cosine", "inverse_sqrt"]),
    (["model.position=rotary"], ["position='rotary'", "rope"]),
    (["model.preset=gpt5"], ["gpt5", "tiny"]),
    (["train.resume=maybe"], ["train.resume='maybe'", "auto", "never"]),
    (["checkpoint.keep=0"], ["checkpoint.keep=0"]),
    (["mesh.data=0"], ["mesh.data=0"]),
    (["model.rope_scaling.fator=2"], ["model.rope_scaling.fator", "factor"]),
    (["steps"], ["key=value"]),
    (["optim.grad_accum=3"], ["train.batch_size=16", "optim.grad_accum=3"]),
    (["model.position=learned", "train.seq_len=512"], ["train.seq_len=512",
                                                        "max_seq_len=256"]),
])
def test_bad_overrides_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(str(REPO / "configs/tiny.yaml"), overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config("nope.yaml")


def test_override_values_take_their_field_type_and_strings_stay_as_typed():
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [
        "train.seed=3", "data.path=/x/y.txt", "train.sample_prompt=def ", "train.run_dir=2024",
        "train.sample_prompt=#x", "optim.clip_norm=null", "data.pack=yes"])
    assert cfg.train.seed == 3 and cfg.data.path == "/x/y.txt" and cfg.train.run_dir == "2024"
    assert cfg.train.sample_prompt == "#x" and cfg.optim.clip_norm is None and cfg.data.pack
    assert load_config(None, ["train.sample_prompt=def "]).train.sample_prompt == "def "
    assert parse_overrides(["model.rope_scaling.factor=4"]) == \
        {"model": {"rope_scaling": {"factor": "4"}}}
    # nothing is evaluated: a YAML tag in an override is just text
    tag = "!!python/object/apply:os.system ['true']"
    assert load_config(None, [f"train.sample_prompt={tag}"]).train.sample_prompt == tag


def test_yaml_files_are_read_safely(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_preset_overrides_merge_rope_scaling():
    cfg = load_config(None, ["model.preset=llama3.1-8b", "model.rope_scaling.factor=16"])
    assert cfg.model.rope_scaling.kind == "llama3" and cfg.model.rope_scaling.factor == 16.0
    assert cfg.model.rope_scaling.original_max_seq_len == 8192
    direct = ModelConfig.preset("llama3.1-8b", rope_scaling={"factor": 16.0})
    assert direct.rope_scaling == cfg.model.rope_scaling


def test_cli_bad_key_is_one_line_and_nonzero(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "train.stepz=1",
                        f"train.run_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown key(s) train.stepz"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_presets_layer_kinds_clear_from_the_command_line():
    """model.layer_pattern= and model.layer_kinds= (empty) drop a preset's pattern (gemma3's
    local and global layers): every layer the model's own kind."""
    assert load_config(None, ["model.preset=gemma3-1b"]).model.layer_kinds
    cfg = load_config(None, ["model.preset=gemma3-1b", "model.layer_pattern=",
                             "model.layer_kinds="]).model
    assert (cfg.layer_pattern, cfg.layer_kinds) == ((), ())


@pytest.mark.parametrize("text,says", [
    ("train: 5\n", "train must be a mapping of its fields; got 5"),
    ("model: 5\n", "model must be a mapping of its fields; got 5"),
    ("data: [1]\n", "data must be a mapping of its fields; got [1]"),
    ("objective: 5\n", "objective must be a mapping of its fields; got 5"),
    ("model:\n  lora:\n    # rank: 4\n", "model.lora must be a mapping of its fields (rank, "
     "alpha, ...); got None"),
    ("model:\n  preset: tiny\n  moe:\n", "model.moe must be a mapping of its fields "
     "(experts, top_k, ...); got None"),
    ("1: 2\n", "unknown config section(s) 1; sections are: model, data"),
    ("model:\n  position: [rope]\n", "model.position=['rope'] must be a string"),
    ("model:\n  layer_pattern: 5\n", "model.layer_pattern=5 must be a list (a,b on the "
     "command line)"),
    ("train:\n  run_dir: [a]\n", "train.run_dir=['a'] must be a string"),
    ("model:\n  layer_kinds: '{d: {mixer: gated_delta}}'\n", "model.layer_kinds='{d: {mixer: "
     "gated_delta}}' must be a mapping of kind names to their fields (window, "),
    ("model:\n  layer_kinds: [a]\n", "model.layer_kinds=['a'] must be a mapping of kind"),
    ("objective:\n  name: [lm]\n", "objective.name=['lm'] is not one of"),
    ("distributed:\n  coordinator_address: {a: 1}\n", "distributed.coordinator_address="
     "{'a': 1} must be host:port"),
])
def test_a_section_or_field_of_the_wrong_shape_in_a_file_is_one_line(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "\n" not in str(e.value) and str(e.value).startswith(says), str(e.value)
    assert load_config(None, ["train.steps=2"]) == RunConfig.from_dict({"train": {"steps": 2},
                                                                       "data": None})


@pytest.mark.parametrize("override", ["model.lora=5", "model.mla=5", "optim.lr=nan",
                                      "optim.lr=inf", "data.val_fraction=nan",
                                      "model.dropout=nan", "optim.clip_norm=-inf"])
def test_a_scalar_section_or_a_non_finite_number_on_the_command_line_is_one_line(override):
    key, value = override.split("=")
    says = (f"{key} must be a mapping of its fields (" if value == "5" else
            f"{key}={value} must be a finite number")
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(says), str(e.value)


def test_cli_init_from_without_a_source_is_one_line(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    (tmp_path / "empty").mkdir()
    for source in (tmp_path / "nothing", tmp_path / "empty", f"{tmp_path / 'nothing'}@3"):
        assert cli.main([f"train.init_from={source}", f"train.run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"error: train.init_from='{source}' is neither a Hugging "
                                    "Face model folder (with config.json) nor a jaxformer run "
                                    "dir (with config.yaml)"], err
    assert not (tmp_path / "run").exists()


def test_train_py_takes_the_file_first_or_as_config_and_names_a_stray_argument(capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for argv, want in [([], ("configs/tiny.yaml", [])),
                       (["c.yaml", "a.b=1"], ("c.yaml", ["a.b=1"])),
                       (["--config", "c.yaml", "a.b=1"], ("c.yaml", ["a.b=1"])),
                       (["a.b=1", "--config=c.yaml"], ("c.yaml", ["a.b=1"])),
                       (["train.init_from=D"], (None, ["train.init_from=D"]))]:
        assert cli.arguments(argv) == want, argv
    usage = "; usage: python train.py [configs/NAME.yaml] [section.key=value ...]\n"
    for argv, says in [(["--lr", "3"], "unknown option(s) --lr (settings are section.key=value)"),
                       (["c.yaml", "d.yaml"], "unexpected argument(s) d.yaml"),
                       (["--config", "c.yaml", "d.yaml"], "unexpected argument(s) d.yaml"),
                       (["--config"], "--config needs a file, got ''"),
                       (["--config", "a.b=1"], "--config needs a file, got 'a.b=1'")]:
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err == f"error: {says}{usage}", argv


# ---- optimizer ------------------------------------------------------------------

def test_inverse_sqrt_is_the_paper_formula():
    d, warmup = 512, 4000
    sched = learning_rate_schedule(OptimConfig(schedule="inverse_sqrt", lr=1.0,
                                               warmup_steps=warmup), ModelConfig(d_model=d), 10**5)
    for count in [0, 1, 10, 3999, 4000, 10**4, 99999]:
        step = count + 1
        want = d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert float(sched(count)) == pytest.approx(want, rel=1e-6)
    # the peak is at the end of warmup: d^-0.5 * warmup^-0.5 (~7e-4 for the base model)
    assert float(sched(warmup - 1)) == pytest.approx(512 ** -0.5 * 4000 ** -0.5, rel=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_decay(schedule):
    cfg = OptimConfig(schedule=schedule, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    sched = learning_rate_schedule(cfg, ModelConfig(), 100)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(5e-4)
    assert float(sched(10)) == pytest.approx(1e-3)
    end = {"cosine": 1e-4, "linear": 1e-4, "constant": 1e-3}[schedule]
    assert float(sched(100)) == pytest.approx(end, rel=1e-5)
    if schedule == "cosine":  # halfway through the decay: (peak + end) / 2
        assert float(sched(55)) == pytest.approx(5.5e-4, rel=1e-4)


def test_decay_mask_only_kernels():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, tie_embeddings=False,
                      position="learned")
    params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    flat = {"/".join(k.key for k in path): v for path, v in
            jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]}
    assert flat["block_0/attn/query/kernel"] and flat["block_0/ffn/wo/kernel"]
    assert flat["lm_head/kernel"]
    for name in ("embed/embedding", "pos_embed/embedding", "block_0/attn_norm/scale",
                 "block_0/attn_norm/bias", "block_0/attn/query/bias", "final_norm/scale"):
        assert not flat[name], name


def test_nonfinite_update_is_skipped_exactly(rng):
    """A NaN gradient leaves params and optimizer state bitwise unchanged."""
    params = {"w": {"kernel": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)}}
    tx, _ = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0), ModelConfig(), 10)
    state = tx.init(params)
    good = {"w": {"kernel": jnp.ones((3, 3))}}
    updates, state = tx.update(good, state, params)
    params = optax.apply_updates(params, updates)
    bad = {"w": {"kernel": jnp.full((3, 3), jnp.nan)}}
    updates, state2 = tx.update(bad, state, params)
    params2 = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params2["w"]["kernel"], params["w"]["kernel"])
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), state2.inner_state,
                        state.inner_state)
    assert all(jax.tree.leaves(same))
    assert int(state2.notfinite_count) == 1 and int(state2.total_notfinite) == 1


def model_params(rng, **kw):
    """A model's params with every kind of leaf (kernels, biases, norm scales, token and
    position embeddings, an untied head), drawn from `rng`."""
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=2, max_seq_len=8,
                      position="learned", tie_embeddings=False, **kw)
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32),
                        shapes["params"])


def test_weight_decay_shrinks_kernels_by_lr_times_wd_and_nothing_else(rng):
    """A step with zero gradient moves only the decayed params (matmul kernels), each by
    exactly -lr * wd * p (AdamW's decoupled decay; Adam's own update is 0 / eps = 0); norm
    scales, biases and embeddings stay bitwise as they were, as docs/training.md promises."""
    params = model_params(rng)
    lr, wd = 0.05, 0.3
    tx, _ = make_optimizer(OptimConfig(lr=lr, weight_decay=wd, warmup_steps=0,
                                       schedule="constant"), ModelConfig(), 10)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    kinds = set()
    for (path, p), q in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                            jax.tree.leaves(new)):
        name, p64 = "/".join(k.key for k in path), np.asarray(p, np.float64)
        kind = path[-1].key
        kinds.add(kind)
        assert kind in ("kernel", "bias", "scale", "embedding"), f"{name}: decay it or not?"
        if kind == "kernel":
            np.testing.assert_allclose(q, p64 * (1 - lr * wd), rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(q, p, err_msg=name)
    assert kinds == {"kernel", "bias", "scale", "embedding"}


@pytest.mark.parametrize("scale", [1e3, 0.3])
def test_clipping_gives_adam_the_clipped_global_norm(rng, scale):
    """Adam's first moment after one step is (1 - b1) * g for the gradient g it was given:
    g / |g| * clip_norm when |g| > clip_norm, g itself otherwise (and with clipping off)."""
    params = model_params(rng)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    grads = jax.tree.map(lambda g: g * (scale / np_global_norm(grads)), grads)  # global norm = scale
    for clip in (1.0, None):
        cfg = OptimConfig(lr=0.01, clip_norm=clip, warmup_steps=0)
        tx, _ = make_optimizer(cfg, ModelConfig(), 10)
        _, state = tx.update(grads, tx.init(params), params)
        mu = optax.tree_utils.tree_get(state, "mu")
        factor = clip / scale if clip is not None and scale > clip else 1.0
        jax.tree.map(lambda m, g: np.testing.assert_allclose(
            np.asarray(m, np.float64) / (1 - cfg.b1), np.asarray(g, np.float64) * factor,
            rtol=1e-5, atol=1e-7 * scale), mu, grads)
