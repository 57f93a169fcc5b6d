"""GLM-4 and GLM-4.5 (jaxformer.hf.glm_layout) against transformers: a random tiny
Glm4ForCausalLM (its sandwich norms under GLM's names, gate|up fused, q/k/v biases, half of
each head rotated in adjacent pairs) and Glm4MoeForCausalLM (per-head QK-norm, q/k/v biases,
half of each head rotated, a dense first layer, sigmoid routing by groups with a random
selection bias, renormalised and scaled, two shared experts; every expert chosen) read by
from_hf give their float32 logits (unscanned and scanned), greedy decoding picks their
tokens, and to_hf writes them back for transformers to read. GLM-4.5's multi-token-prediction
layers are skipped with one line; a setting jaxformer lacks is one line naming the key."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches, covering_draw  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T = 96, 16  # vocab, prompt length
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, attention_bias=True,
              rope_parameters=dict(rope_type="default", rope_theta=1e3,
                                   partial_rotary_factor=0.5))
GLM4_MOE = dict(COMMON, model_type="glm4_moe", num_hidden_layers=3, n_routed_experts=8,
                moe_intermediate_size=16, num_experts_per_tok=2, n_shared_experts=2,
                first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, use_qk_norm=True, num_nextn_predict_layers=0)


def glm_model(seed=None, **keys):
    """transformers' random model of these config.json keys, its selection biases drawn."""
    model = random_hf_model(transformers.AutoConfig.for_model(**keys),
                            int(rng.integers(1 << 31)) if seed is None else seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def assert_reads_and_writes(model, prompts, want, tmp_path):
    """from_hf gives transformers' logits unscanned and scanned, greedy generate its
    tokens, and to_hf a folder transformers reads as the same model."""
    model.save_pretrained(tmp_path / "hf")
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert_greedy_matches(model, cfg, params, prompts)
    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == model.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5
    return cfg


def test_glm4_matches_transformers(tmp_path):
    model = glm_model(**dict(COMMON, model_type="glm4"))
    prompts = rng.integers(0, V, (2, T))
    cfg = assert_reads_and_writes(model, prompts, hf_logits(model, prompts), tmp_path)
    assert cfg.block == "sandwich" and cfg.qkv_bias and not cfg.use_bias
    assert cfg.rope_fraction == 0.5


def test_glm4_moe_matches_transformers(tmp_path):
    model, prompts, want = covering_draw(  # every expert of both sparse layers reached
        lambda seed: glm_model(seed, **GLM4_MOE), rng, (4, T), 8, 2, batches=10)
    cfg = assert_reads_and_writes(model, prompts, want, tmp_path)
    assert cfg.sparse_layers == (False, True, True) and cfg.qk_norm == "head"
    assert (cfg.moe.groups, cfg.moe.topk_groups, cfg.moe.routed_scale) == (2, 1, 2.5)


def test_glm4_moe_skips_multi_token_prediction_layers(tmp_path, capsys):
    """Tensors of a layer past the last (GLM-4.5's multi-token prediction) are skipped on
    import with one line saying so."""
    from safetensors.numpy import load_file, save_file
    model = glm_model(**dict(GLM4_MOE, num_hidden_layers=1, first_k_dense_replace=0,
                             n_group=1, num_nextn_predict_layers=1))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors[name.replace("layers.0.", "layers.1.")] = tensors[name]  # an MTP layer
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg, params = from_hf(tmp_path)
    err = capsys.readouterr().err
    assert "skipping layer(s) 1" in err and "multi-token-prediction" in err
    prompts = rng.integers(0, V, (2, 8))
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
    assert rel_err(got, hf_logits(model, prompts)) < 1e-5


@pytest.mark.parametrize("keys", [
    dict(model_type="glm4", partial_rotary_factor=0.25, rope_theta=5e5),
    dict(model_type="glm4_moe", rope_theta=1e6, n_routed_experts=8, moe_intermediate_size=16),
])
def test_hand_written_config_reads_as_transformers(keys):
    """A config.json of transformers 4 (rope_theta and partial_rotary_factor at the top, or
    no fraction: 0.5), without head_dim: the rotated share, base and head width that
    transformers' config gives."""
    hf = dict(COMMON, **keys)
    for k in ("head_dim", "rope_parameters"):
        hf.pop(k)
    config = transformers.AutoConfig.for_model(**hf)
    cfg = config_from_hf(hf)
    assert cfg.rope_fraction == config.rope_parameters["partial_rotary_factor"]
    assert cfg.rope_theta == config.rope_parameters["rope_theta"]
    assert cfg.head_dim == (getattr(config, "head_dim", None) or 64 // 4)


@pytest.mark.parametrize("keys, words", [
    (dict(model_type="glm4", hidden_act="relu"), ["hidden_act='relu'", "glm4"]),
    (dict(GLM4_MOE, hidden_act="gelu"), ["hidden_act='gelu'", "glm4_moe"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**COMMON, **keys})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
