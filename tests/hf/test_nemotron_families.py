"""Nemotron-H and Granite 4 (jaxformer.hf.nemotron_layout: Mamba-2 layers beside attention,
MLP and mixture-of-experts layers) against transformers itself: a random tiny model
(weights at std 0.1; each Mamba-2 head's A and step drawn so the state lasts the input,
and so that the step's clamp binds: Nemotron-H's below at time_step_min, Granite's at
time_step_limit), saved with save_pretrained, then

- read by from_hf: float32 logits within 1e-5 relative, unscanned and scanned, over a
  prompt longer than the convolution and than two of the mixer's chunks (chunk_size 8);
  Nemotron-H's config.json rewritten with the older hybrid_override_pattern letters;
- greedy cached generate: each new token is transformers' forward argmax (but at a
  near-tie);
- written back by to_hf: from_pretrained reads the same logits.

Relative error is max |ours - transformers| / max |transformers|.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T = 96, 20  # vocab, prompt length: past the convolution (4) and two chunks (8)
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
FAMILIES = {  # model_type: its config.json keys beyond COMMON
    # Mamba-2, MLP, attention, MoE (sigmoid routing in groups, a shared expert)
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
        head_dim=16, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
        ssm_state_size=8, chunk_size=8, time_step_min=0.05, n_routed_experts=4,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, layer_norm_epsilon=1e-5),
    # Mamba-2, attention (RoPE); every layer's FFN experts beside the shared MLP
    "granitemoehybrid": dict(
        num_hidden_layers=2, layer_types=["mamba", "attention"],
        position_embedding_type="rope", rope_parameters=dict(rope_type="default",
                                                              rope_theta=1e4),
        intermediate_size=32, shared_intermediate_size=40, num_local_experts=4,
        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_expand=1,
        mamba_chunk_size=8, time_step_limit=(0.0, 0.5), embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0),
}


def hf_model(model_type, **changes):
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type],
                                                              **changes})
    model = random_hf_model(config, int(rng.integers(1 << 31)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # A in [-0.2, -0.02]: the state outlasts the input
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.02, 0.2)))
            elif name.endswith("dt_bias"):  # steps on both sides of the clamps
                p.copy_(torch.empty_like(p).uniform_(-4.0, 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def as_letters(folder):
    """A Nemotron-H config.json rewritten as older files spell the layers: the letters of
    hybrid_override_pattern (transformers' own spelling of them) for layers_block_type."""
    file = folder / "config.json"
    hf = json.loads(file.read_text())
    letters = transformers.NemotronHConfig(layers_block_type=hf.pop("layers_block_type"))
    file.write_text(json.dumps(dict(hf, hybrid_override_pattern=letters.hybrid_override_pattern)))


OLDER_SPELLING = {"nemotron_h": as_letters}  # config.json rewritten before it is read


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_matches_transformers(model_type, tmp_path):
    model = hf_model(model_type)
    model.save_pretrained(tmp_path / "hf")
    OLDER_SPELLING.get(model_type, lambda folder: None)(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want, model_type)
    assert cfg.mixer_settings("mamba2").chunk == 8 and cfg.recurrent

    assert_greedy_matches(model, cfg, params, prompts)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


def test_dense_nope_granite_matches_transformers(tmp_path):
    """Granite 4 without experts (its shared_mlp is the FFN) and without RoPE; no step
    limit, which config.json spells [0.0, {"__float__": "Infinity"}]; written back as
    granitemoehybrid (a family with experts that ships dense models too)."""
    model = hf_model("granitemoehybrid", num_local_experts=0, position_embedding_type=None,
                     layer_types=["attention", "mamba"], time_step_limit=(0.0, float("inf")))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.position == "none" and not cfg.moe.experts and cfg.d_ff == 40
    want = hf_logits(model, prompts)
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
    assert rel_err(got, want) < 1e-5
    written = to_hf(cfg, params, tmp_path / "out")  # a dense model of a family with experts
    assert written["model_type"] == "granitemoehybrid"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


@pytest.mark.parametrize("model_type, key, value", [
    ("nemotron_h", "moe_latent_size", 16),
    ("granitemoehybrid", "position_embedding_type", "alibi"),
])
def test_unsupported_options_name_the_key_and_the_family(model_type, key, value):
    hf = {**COMMON, **FAMILIES[model_type], "model_type": model_type, key: value}
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf)
    assert f"{key}={value!r}" in str(e.value) and model_type in str(e.value), str(e.value)
