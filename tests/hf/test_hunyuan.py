"""Hunyuan (jaxformer.hf.hunyuan_layout: QK-norm after the rotation, RoPE "dynamic" with an
alpha, the mixture with a shared MLP) against transformers, as tests/hf/test_families.py
and tests/hf/test_moe_families.py test theirs: a random tiny HunYuanDenseV1ForCausalLM and
HunYuanMoEV1ForCausalLM (moe_topk listed per layer, the original checkpoints' rope_scaling
form, every expert chosen) read by from_hf give their logits (unscanned and scanned),
greedy decoding picks their tokens, and to_hf writes them back for transformers to read;
a setting jaxformer lacks is one line naming the key and the family."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches, covering_draw  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, E = 96, 4
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, eod_token_id=None, sep_token_id=None)
DENSE = dict(COMMON, model_type="hunyuan_v1_dense",
             rope_parameters=dict(rope_type="dynamic", alpha=50.0, factor=1.0, rope_theta=1e4))
MOE = dict(COMMON, model_type="hunyuan_v1_moe", num_experts=E, moe_topk=[2, 2],
           rope_theta=1e4, rope_scaling=dict(type="dynamic", alpha=50.0, factor=1.0,
                                             beta_fast=32, beta_slow=1, mscale=1.0,
                                             mscale_all_dim=1.0))


@pytest.mark.parametrize("keys", [DENSE, MOE], ids=["dense", "moe"])
def test_hunyuan_matches_transformers(keys, tmp_path):
    draw = lambda seed: random_hf_model(transformers.AutoConfig.for_model(**keys), seed)  # noqa: E731
    if "num_experts" in keys:  # a batch that reaches every expert of both layers
        model, prompts, want = covering_draw(draw, rng, (2, 12), E, keys["num_hidden_layers"],
                                             top_k=2)  # its router: the top 2 of its logits
    else:
        model, prompts = draw(int(rng.integers(1 << 31))), rng.integers(0, V, (2, 12))
        want = hf_logits(model, prompts)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert (cfg.qk_norm, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == \
        ("head_after_rope", "ntk", 50.0)
    assert_greedy_matches(model, cfg, params, prompts)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == keys["model_type"]
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("keys, words", [
    (dict(MOE, moe_topk=[2, 1]), ["moe_topk=[2, 1]", "hunyuan_v1_moe"]),
    (dict(MOE, num_experts=[4, 4]), ["num_experts=[4, 4]", "hunyuan_v1_moe"]),
    (dict(MOE, moe_intermediate_size=[32, 32]), ["moe_intermediate_size=32", "hunyuan_v1_moe"]),
    (dict(MOE, num_shared_expert=[2, 2]), ["num_shared_expert=[2, 2]", "hunyuan_v1_moe"]),
    (dict(DENSE, use_cla=True), ["use_cla=True", "hunyuan_v1_dense"]),
    (dict(DENSE, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     ["rope_type='dynamic'"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(keys)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
