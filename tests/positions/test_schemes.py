"""model.position_settings: each scheme's own hyperparameters (its entry's settings class,
jaxformer.positions.scheme.PositionSettings, declared beside its math in
jaxformer.positions.biases, jaxformer.positions.absolute, jaxformer.positions.cope and
jaxformer.positions.rotary, gathered by jaxformer.positions.schemes), from YAML, the
command line, the flat keys of earlier versions and a saved run's full config.yaml of
those versions."""

import jax
import numpy as np
import pytest
import yaml

from jaxformer import ConfigError, ModelConfig, Transformer
from jaxformer.core.validation import build_section
from jaxformer.model.config import NESTED
from jaxformer.positions.biases import T5Settings
from jaxformer.positions.schemes import LEGACY_KEYS, POSITION_SCHEMES
from jaxformer.training.config import load_config
from tests.model.test_transformer import np_forward

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

# a saved run's model section as the versions before position_settings wrote it
# (dataclasses.asdict of their ModelConfig: every scheme's flat keys, at their defaults)
OLD_DUMP = """
arch: decoder
encoder_layers: null
tie_source_embed: false
vocab_size: 61
d_model: 32
n_layers: 2
n_heads: 2
n_kv_heads: 2
head_dim: 16
d_ff: 128
max_seq_len: 64
position: rope
rope_theta: 10000.0
rope_scaling:
  kind: none
  factor: 1.0
  original_max_seq_len: null
  low_freq_factor: 1.0
  high_freq_factor: 4.0
  beta_fast: 32.0
  beta_slow: 1.0
  attention_factor: null
  truncate: true
sinusoidal_scale: table
t5_num_buckets: 32
t5_max_distance: 128
norm: layernorm
norm_eps: 1.0e-05
block: pre_ln
ffn: gelu
use_bias: true
qkv_bias: true
tie_embeddings: true
dropout: 0.0
dtype: float32
param_dtype: float32
scan_layers: false
remat: none
sliding_window: null
attention_impl: auto
rope_fraction: 1.0
p_rope: 1.0
cope_positions: 64
qk_norm: none
attn_scale: null
attn_softcap: null
attn_sinks: false
final_softcap: null
embed_norm: false
head_transform: false
head_bias: false
embed_multiplier: 1.0
residual_multiplier: 1.0
logits_multiplier: 1.0
layer_pattern: []
layer_kinds: {}
lora:
  rank: 0
  alpha: 16.0
  dropout: 0.0
  targets:
  - all
  seed: 0
  sweep_rank: []
  sweep_seeds: 1
moe:
  experts: 0
  top_k: 2
  d_ff: null
  shared_experts: 0
  shared_d_ff: null
  shared_gate: false
  router: softmax_topk
  norm_topk: false
  groups: 1
  topk_groups: 1
  routed_scale: 1.0
  layers: null
  bias: false
  capacity_factor: null
  aux_loss: 0.0
  z_loss: 0.0
  bias_update_rate: 0.0
  dispatch: null
mla:
  q_lora_rank: 0
  kv_lora_rank: 0
  qk_nope_head_dim: 0
  qk_rope_head_dim: 0
  v_head_dim: 0
"""


def saved(**changes) -> ModelConfig:
    """The old dump, changed, read as a run dir's config.yaml is (model section alone)."""
    return build_section(ModelConfig, {**yaml.safe_load(OLD_DUMP), **changes}, "model",
                         nested=NESTED)


def test_an_old_full_dump_loads_each_scheme_with_its_flat_keys():
    """The old dump loads whatever its scheme: the chosen scheme's flat keys become its
    settings, the other schemes' (at their old defaults) are dropped; the flat keys are
    None once built and the settings round-trip through to_dict and YAML."""
    assert saved().position_settings == POSITION_SCHEMES["rope"].settings()
    buckets, distance = int(rng.integers(4, 20)), int(rng.integers(21, 300))
    t5 = saved(position="t5", t5_num_buckets=buckets, t5_max_distance=distance)
    assert t5.position_settings == T5Settings(buckets, distance)
    assert saved(position="sinusoidal", sinusoidal_scale="unit").position_settings.scale == "unit"
    assert saved(position="cope", cope_positions=7).position_settings.positions == 7
    assert all(getattr(t5, old) is None for old in LEGACY_KEYS)
    again = build_section(ModelConfig, yaml.safe_load(yaml.safe_dump(t5.to_dict())), "model",
                          nested=NESTED)
    assert again == t5 and again.to_dict()["position_settings"] == {
        "num_buckets": buckets, "max_distance": distance}


def test_an_old_t5_dump_computes_with_its_buckets():
    """A T5 run of the old versions, read from its dump, has its bucket table and gives
    the float64 forward's logits with its own max_distance (a default in its place would
    bucket the far keys apart)."""
    buckets, distance = 8, int(rng.integers(5, 12))
    cfg = saved(position="t5", t5_num_buckets=buckets, t5_max_distance=distance)
    tokens = jax.numpy.asarray(rng.integers(0, cfg.vocab_size, (2, 40)))
    params = Transformer(cfg).init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    assert params["position_bias"]["relative_bias"].shape == (buckets, cfg.n_heads)
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    got = np.asarray(Transformer(cfg).apply({"params": params}, tokens))
    np.testing.assert_allclose(got, np_forward(cfg, params, tokens), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("old, value, new", [
    ("t5_num_buckets", 64, "model.position_settings.num_buckets"),
    ("sinusoidal_scale", "tokens", "model.position_settings.scale"),
    ("cope_positions", 32, "model.position_settings.positions")])
def test_another_schemes_flat_key_off_its_default_is_refused_in_one_line(old, value, new):
    """A rope run with another scheme's flat key changed fails in one line naming the
    key that now holds it and its scheme."""
    with pytest.raises(ConfigError) as e:
        saved(**{old: value})
    scheme = LEGACY_KEYS[old][0]
    assert f"model.{old} is now {new} (with model.position={scheme})" in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_and_command_line_forms():
    """configs/*.yaml's nested section, dotted overrides typed by the scheme's fields,
    today's flat keys mapped; a setting the scheme lacks, or two that disagree, refused."""
    n = int(rng.integers(4, 40))
    cfg = load_config(None, ["model.position=t5", f"model.position_settings.num_buckets={n}",
                             "model.position_settings.max_distance=300"]).model
    assert cfg.position_settings == T5Settings(n, 300)
    flat = load_config(None, ["model.position=t5", f"model.t5_num_buckets={n}",
                              "model.t5_max_distance=300"]).model
    assert flat == cfg
    assert load_config("configs/transformer_base.yaml").model.position_settings.scale == "tokens"
    with pytest.raises(ConfigError, match="position_settings.num_buckets is not a setting of "
                                          "position='rope'"):
        load_config(None, ["model.position_settings.num_buckets=8"])
    with pytest.raises(ConfigError, match="disagree; drop model.t5_num_buckets"):
        ModelConfig(position="t5", t5_num_buckets=8, position_settings={"num_buckets": 16})


def test_replacing_the_position_starts_from_the_new_schemes_defaults():
    """cfg.replace(position=...) (a study sweeping schemes from one base) gets the new
    scheme's default settings, the old scheme's changed ones left behind; settings given
    with it are the new scheme's."""
    n = int(rng.integers(4, 30))
    t5 = ModelConfig(position="t5", position_settings={"num_buckets": n, "max_distance": 64})
    assert t5.replace(position="sinusoidal").position_settings.scale == "table"
    assert t5.replace(position="rope").replace(position="t5").position_settings == T5Settings()
    assert t5.replace(d_model=64).position_settings == T5Settings(n, 64)
    moved = t5.replace(position="cope", position_settings={"positions": n})
    assert moved.position_settings.positions == n
