"""The gated delta rule's hybrids (jaxformer.hf.gated_delta_layout: qwen3_next with its
experts and a dense layer, qwen3_5_text, qwen3_5_moe_text, and a
Qwen3_5ForConditionalGeneration folder's text model) against transformers itself: a random
tiny model (gated delta layers beside gated attention, two key heads each shared by two
value heads, weights at std 0.1, norm weights perturbed so that w vs 1 + w shows, decay
rates A in (0.02, 0.2) so that the state lasts the 20 tokens), saved with save_pretrained,
then

- read by from_hf with the chunk set to 8 (the sequence spans three chunks and is longer
  than the convolution): float32 logits within 1e-5 relative, unscanned and scanned;
- greedy cached generate: each new token is transformers' forward argmax (but at a tie);
- written back by to_hf: from_pretrained reads the same logits;
- a config.json setting jaxformer cannot compute: one ConfigError naming key and family.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import ConfigError, Transformer  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf, to_hf  # noqa: E402
from tests.hf.test_families import hf_logits, random_hf_model, redraw, rel_err  # noqa: E402
from tests.hf.test_moe_families import assert_greedy_matches  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, T, CHUNK = 96, 20, 8
LINEAR, FULL = "linear_attention", "full_attention"
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, linear_num_value_heads=4, linear_num_key_heads=2,
              linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
              layer_types=[LINEAR, FULL, LINEAR, FULL], bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
               shared_expert_intermediate_size=40)
FAMILIES = {  # model_type: its config.json keys beyond COMMON, the type to_hf writes, and
    # whether scanned layers and generate are checked too (Qwen3.5-MoE: its config.json and
    # all-sparse layers; the rest is the two others')
    "qwen3_next": (dict(EXPERTS, mlp_only_layers=[1], layer_types=[LINEAR, LINEAR, FULL,
                                                                   LINEAR]), "qwen3_next", True),
    "qwen3_5_text": (dict(layer_types=[LINEAR, LINEAR, FULL, FULL]), "qwen3_5_text", True),
    "qwen3_5_moe_text": (EXPERTS, "qwen3_next", False),  # Qwen3-Next's routing, all sparse
}


def slow_decay(model):
    """A in (0.02, 0.2) in every gated delta layer: the state carries across chunks."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.2).log())
    return model


def hf_model(config):
    return slow_decay(random_hf_model(config, int(rng.integers(1 << 31))))


def chunked(cfg, chunk: int = CHUNK):
    """cfg with the gated delta layers' chunk set to `chunk`."""
    s = cfg.mixer_settings("gated_delta")
    return cfg.replace(mixer={"gated_delta": dict(s.to_dict(), chunk=chunk)})


@functools.lru_cache(maxsize=None)
def forward(cfg):
    return jax.jit(Transformer(cfg).apply)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_matches_transformers(model_type, tmp_path):
    keys, writes, whole = FAMILIES[model_type]
    model = hf_model(transformers.AutoConfig.for_model(model_type, **{**COMMON, **keys}))
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, V, (2, T))
    want = hf_logits(model, prompts)
    for scan in (True, False) if whole else (False,):  # the unscanned model kept
        cfg, params = from_hf(tmp_path / "hf", scan_layers=scan)
        cfg = chunked(cfg)
        got = np.asarray(forward(cfg)({"params": params}, prompts))
        assert rel_err(got, want) < 1e-5, (model_type, scan, rel_err(got, want))
    if whole:
        assert_greedy_matches(model, cfg, params, prompts[:, :12])
    written = to_hf(cfg, params, tmp_path / "out")  # the chunk: how it runs, not written
    assert written["model_type"] == writes
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


def test_vision_language_folder_reads_its_text_model(tmp_path, capsys):
    """A Qwen3_5ForConditionalGeneration folder: its text model's logits (text alone), the
    vision tower named on stderr as skipped."""
    config = transformers.AutoConfig.for_model(
        "qwen3_5", text_config=COMMON, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=48))
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    redraw(model.named_parameters(), lambda name: "norm" in name)
    slow_decay(model).save_pretrained(tmp_path)
    cfg, params = from_hf(tmp_path)
    assert "vision tower" in capsys.readouterr().err
    prompts = rng.integers(0, V, (2, T))
    got = np.asarray(forward(chunked(cfg))({"params": params}, prompts))
    assert rel_err(got, hf_logits(model, prompts)) < 1e-5


@pytest.mark.parametrize("changes, words", [
    (dict(hidden_act="gelu"), ["hidden_act='gelu'", "qwen3_5_text"]),
    (dict(attention_bias=True), ["attention_bias=True", "qwen3_5_text"]),
    (dict(layer_types=[LINEAR, "sliding_attention", LINEAR, FULL]),
     ["layer_types", "sliding_attention", "qwen3_5_text"]),
])
def test_unsupported_settings_name_the_key_and_the_family(changes, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(dict(COMMON, model_type="qwen3_5_text", **changes))
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_layer_types_default_to_every_interval_th_attending():
    """No layer_types: every full_attention_interval-th layer attends (4 unless given);
    Qwen3.5's MRoPE keys read as plain RoPE on a quarter of each head."""
    hf = {k: v for k, v in COMMON.items() if k != "layer_types"}
    cfg = config_from_hf(dict(hf, model_type="qwen3_5_text", num_hidden_layers=8,
                              full_attention_interval=2, rope_parameters=dict(
                                  rope_type="default", rope_theta=1e7, mrope_interleaved=True,
                                  mrope_section=[2, 1, 1])))
    assert cfg.layer_mixers == ("gated_delta", "attention") * 4
    assert (cfg.rope_theta, cfg.rope_fraction, cfg.norm) == (1e7, 0.25, "rmsnorm_offset")
    cfg = config_from_hf(dict(hf, model_type="qwen3_next", **EXPERTS))
    assert cfg.layer_mixers == ("gated_delta",) * 3 + ("attention",)


def test_a_model_of_gated_delta_layers_alone_reads_as_nope():
    """Every layer linear_attention: nothing attends, so nothing is rotated (position none,
    the rotary fraction dropped), as transformers' model computes it."""
    hf = transformers.AutoConfig.for_model(
        "qwen3_next", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, num_experts=0,
        layer_types=["linear_attention"] * 2).to_dict()
    cfg = config_from_hf(hf)
    assert cfg.position == "none" and cfg.layer_mixers == ("gated_delta", "gated_delta")
