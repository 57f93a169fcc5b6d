"""Llama 4's text model (llama4_text, jaxformer.hf.llama4_layout) against transformers: a
random tiny Llama4ForCausalLM (a dense RoPE layer attending in chunks shorter than the
prompt, a sparse NoPE layer with its temperature tuned within the prompt, a sparse chunked
one; L2 QK-norm; every expert chosen) read by from_hf gives its logits unscanned and
scanned, greedy decoding picks its tokens, and to_hf writes it back for transformers to
read; a setting jaxformer lacks is one line naming the key. Its multimodal folder (llama4,
Llama4ForConditionalGeneration) reads as its text model, the vision model and projector
skipped in one line, and its text model goes back into a copy of the folder."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from tests.hf.test_families import (hf_logits, random_hf_model, read_both_ways,  # noqa: E402
                                    redraw, rel_err)
from tests.hf.test_moe_families import assert_greedy_matches, covering_draw  # noqa: E402

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
E, T = 4, 12
LLAMA4 = dict(model_type="llama4_text", vocab_size=128, hidden_size=64, intermediate_size=32,
              intermediate_size_mlp=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              num_local_experts=E, num_experts_per_tok=2, moe_layers=[1, 2],
              no_rope_layers=[1, 0, 1], attention_chunk_size=5, use_qk_norm=True,
              attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5,
              rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=16),
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_llama4_text_matches_transformers(tmp_path):
    model, prompts, want = covering_draw(
        lambda seed: random_hf_model(transformers.AutoConfig.for_model(**LLAMA4), seed), rng,
        (2, T), E, layers=2, top_k=LLAMA4["num_experts_per_tok"])  # both sparse layers
    model.save_pretrained(tmp_path / "hf")
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want)
    assert [k.chunk for k in cfg.kinds] == [5, None] and cfg.sparse_layers == (False, True, True)

    assert_greedy_matches(model, cfg, params, prompts)

    assert to_hf(cfg, params, tmp_path / "out")["model_type"] == "llama4_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


VISION = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
              projector_output_dim=16)


def mm_logits(model, tokens):
    """The multimodal model's logits of text alone: its language model's, which its forward
    runs on the text's embeddings (that forward fails in transformers 5.24 without image
    outputs, building its output class)."""
    assert model.get_input_embeddings() is model.language_model.get_input_embeddings()
    return hf_logits(model.language_model, tokens)


def test_llama4_folder_reads_and_writes_its_text_model(tmp_path, capsys):
    config = transformers.AutoConfig.for_model(
        "llama4", text_config={k: v for k, v in LLAMA4.items() if k != "model_type"},
        vision_config=VISION)
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.AutoModelForImageTextToText.from_config(
        config, attn_implementation="eager").eval()
    redraw(model.named_parameters(), lambda name: "norm" in name)
    model.save_pretrained(tmp_path / "mm")
    prompts = rng.integers(0, 128, (2, T))
    want = mm_logits(model, prompts)  # the multimodal model, text alone
    capsys.readouterr()
    cfg, params = from_hf(tmp_path / "mm")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision_model." in err[0] and "multi_modal_projector." in err[0]
    forward = jax.jit(Transformer(cfg).apply)
    assert rel_err(np.asarray(forward({"params": params}, prompts)), want) < 1e-5

    assert to_hf(cfg, params, tmp_path / "text")["model_type"] == "llama4_text"
    noisy = jax.tree.map(lambda p: p + 0.05 * rng.standard_normal(p.shape, np.float32), params)
    to_hf(cfg, noisy, tmp_path / "back", into=tmp_path / "mm")
    back = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert rel_err(mm_logits(back, prompts),
                   np.asarray(forward({"params": noisy}, prompts))) < 1e-5


@pytest.mark.parametrize("keys, words", [
    (dict(attention_bias=True), ["attention_bias=True", "llama4_text"]),
    (dict(layer_types=["chunked_attention", "sliding_attention", "full_attention"]),
     ["layer_types=", "llama4_text"]),
    (dict(attention_chunk_size=None, layer_types=["chunked_attention"] * 3),
     ["attention_chunk_size=None", "llama4_text"]),
])
def test_unsupported_settings_name_the_key_and_the_family(keys, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf({k: v for k, v in {**LLAMA4, **keys}.items() if k != "rope_parameters"})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
