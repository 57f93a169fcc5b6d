"""ERNIE 4.5 and ERNIE 4.5 MoE (jaxformer.hf.ernie_layout) against transformers, as
tests/hf/test_families.py tests the attention families: a random tiny
Ernie4_5ForCausalLM / Ernie4_5_MoeForCausalLM (biases on, q/k rotated in interleaved
pairs, head_dim its own; the MoE's selection bias drawn, every expert chosen, dense layers
before and after the sparse ones) read by from_hf gives its logits unscanned and scanned,
greedy decoding picks its tokens, and to_hf writes it back for transformers to read (and
to_peft LoRA adapters for peft to apply to that base); the sparse layers are those transformers' decoder builds; what jaxformer lacks is one line."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer, param_shapes  # noqa: E402
from jaxformer.convert import config_from_hf, config_to_hf, to_hf  # noqa: E402
from jaxformer.convert.peft import to_peft  # noqa: E402
from jaxformer.model import lora  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, read_both_ways, rel_err  # noqa: E402
from tests.hf.test_moe_families import (assert_greedy_matches, covering_draw,  # noqa: E402
                                        router_scores)

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T = 96, 14
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=64, use_bias=True, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
MOE = dict(COMMON, model_type="ernie4_5_moe", num_hidden_layers=3, moe_num_experts=4, moe_k=2,
           moe_intermediate_size=24, moe_num_shared_experts=2, moe_layer_start_index=1,
           moe_layer_end_index=1)  # layers 0 and 2 dense


def assert_parity(folder, prompts, want):
    """from_hf's logits within 1e-5 of `want`, unscanned and scanned; (cfg, params)."""
    cfg, params = read_both_ways(folder, prompts, want)
    return cfg, params


def read_back(folder, prompts):
    return hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval(), prompts)


def test_ernie4_5_matches_transformers(tmp_path):
    model = random_hf_model(transformers.AutoConfig.for_model("ernie4_5", **COMMON),
                            int(rng.integers(1 << 31)))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)
    cfg, params = assert_parity(tmp_path / "hf", prompts, want)
    assert_greedy_matches(model, cfg, params, prompts)
    # a dense ERNIE 4.5 computes as a Llama, written so unless asked for its own type
    assert config_to_hf(cfg)["model_type"] == "llama"
    assert to_hf(cfg, params, tmp_path / "out", model_type="ernie4_5")["model_type"] == \
        "ernie4_5"
    assert rel_err(read_back(tmp_path / "out", prompts), want) < 1e-5
    assert_peft_adapts_the_ernie_base(cfg, params, tmp_path, prompts, want)


def assert_peft_adapts_the_ernie_base(cfg, params, tmp_path, prompts, want):
    """LoRA adapters on every projection, exported by to_peft for the ernie4_5 base in
    tmp_path/out (its q/k rows interleaved): peft's adapted model gives our logits."""
    peft = pytest.importorskip("peft")
    lcfg = cfg.replace(lora=dict(rank=2, alpha=4.0))
    def draw(path, x):  # each adapter's scale its alpha / rank, A and B N(0, 0.1)
        scale = path[-1].key == "lora_scale"
        return np.full(x.shape, 2.0, x.dtype) if scale else \
            rng.normal(0, 0.1, x.shape).astype(x.dtype)

    drawn = jax.tree_util.tree_map_with_path(draw, param_shapes(lcfg))
    adapters, scales, _ = lora.partition(drawn, scales=True)
    lparams = lora.combine(params, adapters, scales)
    ours = np.asarray(jax.jit(Transformer(lcfg).apply)({"params": lparams}, prompts))
    assert rel_err(ours, want) > 1e-2  # the adapters matter
    to_peft(lcfg, lparams, tmp_path / "adapter", model_type="ernie4_5")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert rel_err(hf_logits(adapted, prompts), ours) < 1e-5


def ernie_scores(model, tokens):
    """transformers' logits, and each sparse layer's selection scores: softmax(router
    logits) + the layer's selection bias."""
    sparse = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    return router_scores(model, tokens, lambda logits, i: torch.softmax(logits, -1)
                         + sparse[i].moe_statics.e_score_correction_bias[0])


def test_ernie4_5_moe_matches_transformers(tmp_path):
    model, prompts, want = covering_draw(
        lambda seed: random_hf_model(transformers.AutoConfig.for_model(**MOE), seed), rng,
        (2, T), experts=4, layers=1, scores=ernie_scores)
    bias = model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias
    assert float(bias.abs().min()) > 0  # drawn: the choice is not the weights'
    model.save_pretrained(tmp_path / "hf")
    cfg, params = assert_parity(tmp_path / "hf", prompts, want)
    assert cfg.sparse_layers == (False, True, False) and cfg.head_bias
    assert_greedy_matches(model, cfg, params, prompts)
    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "ernie4_5_moe"
    assert rel_err(read_back(tmp_path / "out", prompts), want) < 1e-5


@pytest.mark.parametrize("start, end, every", [(1, -1, 1), (0, 4, 2), (2, 3, 3)])
def test_sparse_layers_as_transformers_chooses_them(start, end, every):
    """moe_layer_start_index / end_index / interval: the sparse layers are those
    transformers' decoder gives experts, and config_to_hf writes keys that read back so."""
    hf = dict(MOE, num_hidden_layers=6, moe_layer_start_index=start, moe_layer_end_index=end,
              moe_layer_interval=every)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf))
    want = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    cfg = config_from_hf(hf)
    assert cfg.sparse_layers == want
    assert config_from_hf(config_to_hf(cfg)).sparse_layers == want


@pytest.mark.parametrize("model_type, keys", [
    ("ernie4_5", {}), ("ernie4_5_moe", dict(moe_num_experts=8, moe_intermediate_size=16))])
def test_a_config_json_of_sizes_alone_reads_as_transformers_reads_it(model_type, keys):
    """The row's defaults are transformers' (head_dim, kv heads, tie, RoPE base, epsilon,
    biases; the sparse layers, experts per token and shared experts' width)."""
    hf = dict(model_type=model_type, vocab_size=V, hidden_size=64, intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=8, **keys)
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    cfg, attn = config_from_hf(hf), model.model.layers[0].self_attn
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.tie_embeddings, cfg.norm_eps, cfg.rope_theta) == \
        (attn.head_dim, config.num_key_value_heads, config.tie_word_embeddings,
         config.rms_norm_eps, config.rope_parameters["rope_theta"])
    assert not cfg.use_bias and not cfg.qkv_bias and attn.q_proj.bias is None
    if keys:
        mlp = model.model.layers[-1].mlp
        assert cfg.sparse_layers == tuple(hasattr(x.mlp, "experts") for x in model.model.layers)
        assert (cfg.moe.top_k, cfg.shared_d_ff) == (config.num_experts_per_tok,
                                                    mlp.shared_experts.gate_proj.out_features)


@pytest.mark.parametrize("keys, words", [
    (dict(moe_norm_min=1e-6), ["moe_norm_min=1e-06", "ernie4_5_moe"]),
    (dict(moe_layer_interval=0), ["moe_layer_interval=0", "ernie4_5_moe"]),
    (dict(model_type="ernie4_5", rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                      partial_rotary_factor=0.5)),
     ["partial_rotary_factor=0.5", "ernie4_5"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**MOE, **keys})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_models_ernie_cannot_write_are_refused():
    """Sparse layers no start, end and interval choose; a window asked of ernie4_5."""
    cfg = config_from_hf(dict(MOE, num_hidden_layers=5, moe_layer_start_index=0))
    with pytest.raises(ConfigError, match=r"model\.moe\.layers=\[0, 1, 3\].*interval"):
        config_to_hf(cfg.replace(moe=cfg.moe.replace(layers=(0, 1, 3))),
                     model_type="ernie4_5_moe")
    dense = config_from_hf(dict(COMMON, model_type="ernie4_5"))
    with pytest.raises(ConfigError, match="model_type='ernie4_5' cannot write.*sliding_window"):
        config_to_hf(dense.replace(sliding_window=4), model_type="ernie4_5")
