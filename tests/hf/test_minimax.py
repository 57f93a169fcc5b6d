"""MiniMax-M2 (jaxformer.hf.minimax_layout) against transformers: a random tiny
MiniMaxM2ForCausalLM (QK-norm over the whole projection, half of each head rotated through
rotary_dim, sigmoid routing with a random selection bias, every expert chosen) read by
from_hf gives its logits unscanned and scanned, greedy decoding picks its tokens, and to_hf
writes it back as minimax_m2 for transformers to read; rotary_dim reads as transformers
reads it; MiniMax's keys of another model are one line naming the key."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import (assert_greedy_matches, covering_draw,  # noqa: E402
                                        router_scores)

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, E = 96, 4  # vocab, experts
MINIMAX = dict(model_type="minimax_m2", vocab_size=V, hidden_size=64, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rotary_dim=8, num_local_experts=E, num_experts_per_tok=2,
               max_position_embeddings=128, rope_theta=1e4, rms_norm_eps=1e-5,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)


def sigmoid_scores(model, tokens, biases):
    """transformers' logits, and each sparse layer's selection scores: sigmoid(router
    logits) + the layer's selection bias (`biases`, in order)."""
    return router_scores(model, tokens, lambda logits, i: torch.sigmoid(logits) + biases[i])


def minimax_model(seed):
    model = random_hf_model(transformers.AutoConfig.for_model(**MINIMAX), seed)
    with torch.no_grad():  # the selection bias is a buffer: random too
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def test_minimax_m2_matches_transformers(tmp_path):
    model, prompts, want = covering_draw(
        minimax_model, rng, (2, 14), E, MINIMAX["num_hidden_layers"],
        MINIMAX["num_experts_per_tok"], scores=lambda m, tokens: sigmoid_scores(
            m, tokens, [layer.mlp.e_score_correction_bias for layer in m.model.layers]))
    model.save_pretrained(tmp_path / "hf")
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert cfg.rope_fraction == 0.5 and cfg.qk_norm == "projection"

    assert_greedy_matches(model, cfg, params, prompts)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "minimax_m2"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.rotary_dim == 8
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("keys", [
    dict(rotary_dim=4),
    dict(rotary_dim=4, partial_rotary_factor=0.5),
    dict(rotary_dim=4, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                            partial_rotary_factor=0.25)),
    dict(rotary_dim=None),
])
def test_rotary_dim_reads_as_transformers_reads_it(keys):
    hf = {k: v for k, v in dict(MINIMAX, **keys).items() if v is not None}
    config = transformers.MiniMaxM2Config.from_dict(hf)
    assert config_from_hf(hf).rope_fraction == \
        config.rope_parameters.get("partial_rotary_factor", 1.0)


@pytest.mark.parametrize("keys, words", [
    (dict(router_jitter_noise=0.1), ["router_jitter_noise=0.1"]),
    (dict(scoring_func="softmax"), ["scoring_func='softmax'"]),
    (dict(use_qk_norm=False), ["use_qk_norm=False"]),
    (dict(attn_type_list=[0, 1]), ["attn_type_list=[0, 1]"]),
    (dict(shared_intermediate_size=16), ["shared_intermediate_size=16"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(dict(MINIMAX, **keys))
    assert "\n" not in str(e.value)
    for w in words + ["minimax_m2"]:
        assert w in str(e.value), (w, str(e.value))
