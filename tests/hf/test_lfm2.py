"""LFM2 (gated short convolutions beside attention, jaxformer.hf.lfm2_layout) against
transformers, as tests/hf/test_families.py tests the attention families: a random tiny
Lfm2ForCausalLM read by from_hf gives its logits (unscanned and scanned) on a sequence
longer than the convolution, greedy decoding picks its tokens, and to_hf writes it back
for transformers to read (an Lfm2MoeForCausalLM too); config.json's width keys read as
Lfm2MLP sizes its MLP; a setting jaxformer lacks is one line naming the key."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from jaxformer.decode import generate  # noqa: E402
from tests.conftest import assert_greedy_up_to_near_ties  # noqa: E402
from tests.hf.test_families import (COMMON, hf_logits, random_hf_model, read_both_ways,  # noqa: E402
                                    rel_err)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
LFM2 = dict(COMMON, model_type="lfm2", intermediate_size=144, block_multiple_of=32,
            block_ffn_dim_multiplier=1.5, conv_L_cache=4, conv_bias=True,
            tie_word_embeddings=False,
            layer_types=["conv", "full_attention", "conv", "conv"])  # no period: 4 kinds' names


def test_lfm2_matches_transformers(tmp_path):
    model = random_hf_model(transformers.AutoConfig.for_model(**LFM2),
                            int(rng.integers(1 << 31)))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, 128, (2, 12))  # 12 tokens: three times the 4 taps
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)

    new = np.asarray(generate(Transformer(cfg), params, prompts, max_new_tokens=6,
                              rng=jax.random.key(0), temperature=0).tokens)
    logits = hf_logits(model, np.concatenate([prompts, new], 1))[:, 11:-1]  # [2, 6, V]
    assert_greedy_up_to_near_ties(new, logits)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "lfm2"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


def test_lfm2_moe_matches_transformers(tmp_path):
    """LFM2-MoE: a dense first layer, then sparse ones routed by sigmoid scores with a
    selection bias (drawn, not zero) and a scale; read and written back."""
    config = transformers.AutoConfig.for_model(
        **dict(LFM2, model_type="lfm2_moe", intermediate_size=96), moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.5)
    model = random_hf_model(config, int(rng.integers(1 << 31)))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.feed_forward.expert_bias.copy_(0.3 * torch.randn(8))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, 128, (2, 12))
    want = hf_logits(model, prompts)
    cfg, params = from_hf(tmp_path / "hf")
    assert rel_err(np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts)),
                   want) < 1e-5
    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "lfm2_moe"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("keys", [
    dict(block_ff_dim=200, block_multiple_of=48, block_ffn_dim_multiplier=1.3,
         full_attn_idxs=[1, 2], tie_embedding=False, rope_theta=5e4),
    dict(block_ffn_dim_multiplier=1, tie_word_embeddings=True),
    dict(block_auto_adjust_ff_dim=False, full_attn_idxs=[3], conv_L_cache=2),
])
def test_config_json_reads_as_transformers_builds(keys):
    """The legacy and width keys: the MLP width Lfm2MLP builds, the layer types, the tie,
    the RoPE base and the taps of transformers' config of the same config.json."""
    hf = dict(COMMON, model_type="lfm2", intermediate_size=int(rng.integers(100, 300)), **keys)
    config = transformers.Lfm2Config.from_dict(hf)
    cfg = config_from_hf(hf)
    assert cfg.d_ff == Lfm2MLP(config).w1.out_features
    assert [cfg.layer_mixers[i] == "attention" for i in range(4)] == \
        [t == "full_attention" for t in config.layer_types]
    assert cfg.tie_embeddings == config.tie_word_embeddings
    assert cfg.rope_theta == config.rope_parameters["rope_theta"]
    assert cfg.mixer_settings("short_conv").kernel == config.conv_L_cache


@pytest.mark.parametrize("keys, words", [
    (dict(layer_types=["conv", "sliding_attention", "conv", "conv"]),
     ["layer_types=['sliding_attention']", "lfm2"]),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     ["partial_rotary_factor=0.5", "lfm2"]),
    (dict(model_type="lfm2_moe", layer_types=["conv"] * 4, moe_intermediate_size=8,
          num_experts=4, use_expert_bias=False), ["use_expert_bias=False", "lfm2_moe"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**COMMON, "model_type": "lfm2", "intermediate_size": 96, **keys})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
