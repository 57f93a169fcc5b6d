"""Arcee's AFMoE (jaxformer.hf.afmoe_layout) against transformers: a random tiny
AfmoeForCausalLM (sliding layers with a window shorter than the input beside NoPE global
ones, four norms per layer, gated attention, muP's embedding scale, a dense first layer,
then sigmoid routing with a random selection bias, a route scale, shared experts, every
expert chosen) read by from_hf gives its logits unscanned and scanned, greedy decoding
picks its tokens, and to_hf writes it back as afmoe for transformers to read; a setting
jaxformer lacks is one line naming the key and the family."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_minimax import sigmoid_scores  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches, covering_draw  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
AFMOE = dict(model_type="afmoe", vocab_size=96, hidden_size=64, intermediate_size=48,
             moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             num_shared_experts=2, num_dense_layers=1, global_attn_every_n_layers=2,
             sliding_window=4, mup_enabled=True, route_scale=2.0, max_position_embeddings=128,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_afmoe_matches_transformers(tmp_path):
    model, prompts, want = covering_draw(  # expert_bias: a param, drawn too
        lambda seed: random_hf_model(transformers.AutoConfig.for_model(**AFMOE), seed), rng,
        (2, 14), AFMOE["num_experts"], 2, AFMOE["num_experts_per_tok"],
        scores=lambda m, tokens: sigmoid_scores(
            m, tokens, [layer.mlp.expert_bias for layer in m.model.layers[1:]]))
    model.save_pretrained(tmp_path / "hf")
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert cfg.layer_pattern == ("sliding", "full_nope")  # the global layers NoPE
    assert cfg.sparse_layers == (False, True, True)
    free = copy.deepcopy(model.config)  # the window binds: without it, another answer
    free.sliding_window = 1 << 20
    unbound = transformers.AutoModelForCausalLM.from_config(free, attn_implementation="eager")
    unbound.load_state_dict(model.state_dict())
    assert rel_err(hf_logits(unbound.eval(), prompts), want) > 1e-3

    assert_greedy_matches(model, cfg, params, prompts)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "afmoe"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.mup_enabled and back.config.layer_types == model.config.layer_types
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("keys, words", [
    (dict(attention_bias=True), ["attention_bias=True"]),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     ["partial_rotary_factor=0.5"]),
    (dict(hidden_act="relu"), ["hidden_act='relu'"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(dict(AFMOE, **keys))
    assert "\n" not in str(e.value)
    for w in words + ["afmoe"]:
        assert w in str(e.value), (w, str(e.value))
