"""The Mamba-2 families of jaxformer.hf.mamba2_layout (mamba2: Mamba-2 mixers alone; bamba:
Mamba-2 and attention layers with SwiGLU MLPs) against transformers, as
tests/hf/test_families.py tests the others: a random tiny model saved with save_pretrained,
read by from_hf (float32 logits within 1e-5 relative, unscanned and scanned), greedy cached
generate against transformers' forward argmax, and written back by to_hf for
from_pretrained to read the same logits. The sequences are longer than the convolution
and than one chunk (chunk_size 8); the decays are drawn so the state lasts the sequence,
and some steps reach the time step limit."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")


from jaxformer import ConfigError  # noqa: E402
from jaxformer.convert import config_from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
FAMILIES = {  # model_type: its config.json keys beyond COMMON
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16,
                   conv_kernel=4, chunk_size=8, use_bias=True, tie_word_embeddings=True,
                   time_step_limit=(0.0, 0.2)),
    "bamba": dict(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, attn_layer_indices=[1, 3], mamba_n_heads=8,
                  mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                  mamba_chunk_size=8, mamba_conv_bias=True, time_step_limit=(0.05, 0.2)),
}
BAMBA_SIZES = dict(mamba_n_heads=8, num_attention_heads=4, intermediate_size=96)
PROMPT, NEW = 13, 6  # the prompt: longer than the convolution and than one chunk


def hf_model(model_type):
    """A random tiny model (test_families' weights), its Mamba-2 steps softplus(dt_bias +
    ...) around 0.13 and rates exp(A_log) in [0.02, 0.2]: the state decays by at most a
    few percent a step."""
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **FAMILIES[model_type])
    model = random_hf_model(config, int(rng.integers(1 << 31)))
    return lasting_states(model)


def lasting_states(model):
    """model with its Mamba-2 steps softplus(dt_bias + ...) around 0.13 and rates
    exp(A_log) in [0.02, 0.2], drawn afresh: its states last the test's sequence."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(np.log(0.02), np.log(0.2)))
    return model


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_matches_transformers(model_type, tmp_path):
    model = hf_model(model_type)
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, 128, (2, PROMPT))
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want, model_type)
    assert cfg.mixer_settings("mamba2").chunk == 8 < PROMPT

    assert_greedy_matches(model, cfg, params, prompts, NEW)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("config, words", [
    (dict(COMMON, model_type="mamba2", num_heads=8, hidden_act="gelu"),
     ["hidden_act='gelu'", "mamba2"]),
    (dict(COMMON, model_type="mamba2", num_heads=8, head_dim=16, expand=3),
     ["expand=3", "mamba2"]),
    (dict(COMMON, model_type="bamba", **BAMBA_SIZES, attention_bias=True),
     ["attention_bias=True", "bamba"]),
    (dict(COMMON, model_type="bamba", **BAMBA_SIZES, time_step_limit=[0.5, 0.1]),
     ["time_step_limit=[0.5, 0.1]", "bamba"]),
])
def test_unsupported_options_name_the_key_and_the_family(config, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(config)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
