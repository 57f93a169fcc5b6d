"""Seed-OSS (jaxformer.hf.seed_oss_layout) against transformers, as
tests/hf/test_families.py tests the attention families: a random tiny SeedOssForCausalLM
(biases on q, k, v, o and the MLP, head_dim its own, not hidden_size / heads) read by
from_hf gives its logits unscanned and scanned, greedy decoding picks its tokens, and
to_hf writes it back for transformers to read; its three bias keys are written as the
family that reads them back; a bias pair jaxformer lacks is one line."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, config_to_hf, to_hf  # noqa: E402
from jaxformer.convert.hf_config import differences  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T = 96, 14
SEED_OSS = dict(model_type="seed_oss", vocab_size=V, hidden_size=64, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=64, attention_bias=True, attention_out_bias=True,
                mlp_bias=True, attention_dropout=0.1, residual_dropout=0.1,
                rope_parameters=dict(rope_type="default", rope_theta=1e4),
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_seed_oss_matches_transformers(tmp_path):
    model = random_hf_model(transformers.AutoConfig.for_model(**SEED_OSS),
                            int(rng.integers(1 << 31)))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert cfg.head_dim == 32 and cfg.dropout == 0.0  # the dropouts act in training alone
    assert_greedy_matches(model, cfg, params, prompts)

    written = to_hf(cfg, params, tmp_path / "out", model_type="seed_oss")
    assert written["model_type"] == "seed_oss" and written["residual_dropout"] == 0.0
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == "SeedOssForCausalLM"
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("qkv, out, family", [
    (True, False, "qwen2"),     # the released models: q, k, v biased alone
    (False, False, "llama"),
    (False, True, "seed_oss"),  # o and the MLP biased, not q, k, v: Seed-OSS alone
])
def test_bias_keys_are_written_by_the_family_that_reads_them(qkv, out, family):
    """attention_bias (q, k, v), attention_out_bias and mlp_bias (o, MLP) read as
    qkv_bias and use_bias, as transformers' model has the biases; to_hf's first family
    that reads the model back writes it."""
    hf = dict(SEED_OSS, attention_bias=qkv, attention_out_bias=out, mlp_bias=out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf))
    layer = model.model.layers[0]
    cfg = config_from_hf(hf)
    assert cfg.qkv_bias == (layer.self_attn.q_proj.bias is not None) == qkv
    assert cfg.use_bias == (layer.self_attn.o_proj.bias is not None) == \
        (layer.mlp.down_proj.bias is not None) == out
    written = config_to_hf(cfg)
    assert written["model_type"] == family
    assert differences(cfg, config_from_hf(written)) == []


def test_a_config_json_of_sizes_alone_reads_as_transformers_reads_it():
    """The row's defaults are transformers' (head_dim, kv heads, tie, RoPE base, epsilon,
    the biases on q, k, v alone)."""
    hf = dict(model_type="seed_oss", vocab_size=V, hidden_size=64, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=16)
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    cfg, attn = config_from_hf(hf), model.model.layers[0].self_attn
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.tie_embeddings, cfg.norm_eps, cfg.rope_theta) == \
        (attn.head_dim, config.num_key_value_heads, config.tie_word_embeddings,
         config.rms_norm_eps, config.rope_parameters["rope_theta"])
    assert (cfg.qkv_bias, cfg.use_bias) == (attn.q_proj.bias is not None,
                                            attn.o_proj.bias is not None) == (True, False)


def test_unsupported_bias_pair_names_the_keys_and_the_family():
    with pytest.raises(ConfigError) as e:
        config_from_hf(dict(SEED_OSS, attention_out_bias=True, mlp_bias=False))
    assert "\n" not in str(e.value)
    for w in ("attention_out_bias=True", "mlp_bias=False", "seed_oss"):
        assert w in str(e.value), (w, str(e.value))
