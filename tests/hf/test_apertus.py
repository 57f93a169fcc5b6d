"""Apertus (jaxformer.hf.apertus_layout: a gateless xIELU MLP with learned scalars per
layer, QK-norm, Llama 3's RoPE scaling by default) against transformers, as
tests/hf/test_families.py tests the Llama-layout families: a random tiny
ApertusForCausalLM (its xIELU scalars drawn, eps negative enough to bind) read by from_hf
gives its logits (unscanned and scanned), greedy decoding picks its tokens, and to_hf
writes it back for transformers to read; a setting jaxformer lacks is one line naming
the key and the family."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V = 96
APERTUS = dict(model_type="apertus", vocab_size=V, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)  # no rope_parameters: ApertusConfig's Llama 3 scaling


def test_apertus_matches_transformers(tmp_path):
    model = random_hf_model(transformers.AutoConfig.for_model(**APERTUS),
                            int(rng.integers(1 << 31)))
    with torch.no_grad():  # xIELU's beta and eps are buffers: drawn too
        for layer in model.model.layers:
            layer.mlp.act_fn.beta.copy_(torch.tensor(rng.uniform(0.3, 0.7)))
            layer.mlp.act_fn.eps.copy_(torch.tensor(-rng.uniform(0.05, 0.2)))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, 12))
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert cfg.rope_scaling.kind == "llama3" and cfg.ffn == "xielu"
    assert_greedy_matches(model, cfg, params, prompts)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "apertus"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("keys, words", [
    (dict(hidden_act="silu"), ["hidden_act='silu'", "apertus"]),
    (dict(attention_bias=True), ["attention_bias=True", "apertus"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**APERTUS, **keys})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_without_rope_keys_reads_as_apertus_config_fills_it():
    """A hand-written config.json without RoPE keys: transformers' default, Llama 3's
    scaling at base 1.2e7."""
    params = transformers.ApertusConfig(**{k: v for k, v in APERTUS.items()
                                           if k != "model_type"}).rope_parameters
    s = config_from_hf(APERTUS).rope_scaling
    assert config_from_hf(APERTUS).rope_theta == params["rope_theta"]
    assert (s.kind, s.factor, s.original_max_seq_len, s.low_freq_factor, s.high_freq_factor) \
        == (params["rope_type"], params["factor"], params["original_max_position_embeddings"],
            params["low_freq_factor"], params["high_freq_factor"])
