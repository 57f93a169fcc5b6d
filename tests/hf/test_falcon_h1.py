"""Falcon-H1 (jaxformer.hf.falcon_h1_layout: attention and Mamba-2 side by side in every
layer, their outputs summed, then the MLP; its muP multipliers) against transformers, as
tests/hf/test_families.py tests the others: a random tiny model with every multiplier away
from 1, saved with save_pretrained, read by from_hf (float32 logits within 1e-5 relative,
unscanned and scanned), greedy cached generate against transformers' forward argmax, and
written back by to_hf for from_pretrained to read the same logits. The sequences are
longer than the convolution and than one chunk (chunk 8); the decays are drawn so the
state lasts the sequence."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, hf_config, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, rel_err  # noqa: E402
from tests.hf.test_mamba2_families import lasting_states  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head="auto", mamba_n_groups=2,
              mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
              embedding_multiplier=1.7, lm_head_multiplier=0.6, key_multiplier=1.4,
              attention_in_multiplier=0.8, attention_out_multiplier=1.3,
              ssm_in_multiplier=1.2, ssm_out_multiplier=0.7,
              ssm_multipliers=[1.3, 0.8, 1.2, 0.9, 1.5], mlp_multipliers=[1.6, 0.7])
CASES = {  # the gated norm, norm before the gate, biases; and neither norm nor biases
    "norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True,
                 mlp_bias=True, projectors_bias=True),
    "plain": dict(mamba_rms_norm=False, mamba_proj_bias=True, tie_word_embeddings=True),
}
PROMPT, NEW = 13, 5  # the prompt: longer than the convolution and than one chunk


def hf_model(case):
    """A random tiny model (test_families' weights), its Mamba-2 steps softplus(dt_bias +
    ...) around 0.13 and rates exp(A_log) in [0.02, 0.2]: the state lasts the sequence."""
    config = transformers.AutoConfig.for_model("falcon_h1", **CONFIG, **CASES[case])
    model = random_hf_model(config, int(rng.integers(1 << 31)))
    return lasting_states(model)


@pytest.mark.parametrize("case", list(CASES))
def test_falcon_h1_matches_transformers(case, tmp_path):
    model = hf_model(case)
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, 128, (2, PROMPT))
    want = hf_logits(model, prompts)
    for scan in (False, True):
        cfg, params = from_hf(tmp_path / "hf", scan_layers=scan)
        got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
        assert rel_err(got, want) < 1e-5, (case, scan, rel_err(got, want))
        assert "parallel_mixer" in params["blocks" if scan else "block_0"]
    assert cfg.mixer_settings("mamba2").chunk == 8 < PROMPT

    assert_greedy_matches(model, cfg, params, prompts, NEW)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == "falcon_h1"
    assert hf_config.differences(cfg, config_from_hf(written)) == []
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("mamba_d_ssm", 100)])
def test_unsupported_options_name_the_key_and_the_family(key, value):
    with pytest.raises(ConfigError) as e:
        config_from_hf(dict(CONFIG, model_type="falcon_h1", **{key: value}))
    assert "\n" not in str(e.value)
    for w in (f"{key}={value!r}", "falcon_h1"):
        assert w in str(e.value), (w, str(e.value))


def test_a_parallel_hybrid_at_unit_multipliers_is_written_as_falcon_h1():
    """The export compares each layer's parallel mixer: a Falcon-H1 whose multipliers are
    all 1 is no Llama-layout family's model (their layers have no Mamba beside attention),
    so the first type whose config reads back as it is falcon_h1."""
    units = {k: 1.0 for k in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier",
                              "attention_in_multiplier", "attention_out_multiplier",
                              "ssm_in_multiplier", "ssm_out_multiplier")}
    cfg = config_from_hf(dict(CONFIG, model_type="falcon_h1", ssm_multipliers=[1.0] * 5,
                              mlp_multipliers=[1.0, 1.0], **units))
    assert hf_config.export_model_type(cfg) == "falcon_h1"
