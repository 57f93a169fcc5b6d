"""Today's open model families (jaxformer.convert) against transformers itself, one row
per model type (jaxformer.hf.families, and what the rows are made of: config.json read by
jaxformer.hf.config_json with jaxformer.hf.rope, jaxformer.hf.layers, jaxformer.hf.scales
and jaxformer.hf.twists; tensors mapped by jaxformer.hf.tensors in the layouts
jaxformer.hf.llama_layout, jaxformer.hf.gpt2 and jaxformer.hf.gpt_neox; folders read by
jaxformer.hf.folder): a random tiny model with its family's layer pattern and windows shorter
than the input, weights at std 0.1 and norm weights perturbed (so that w vs 1 + w, a
missing norm or cap shows), saved with save_pretrained, then

- read by from_hf: float32 logits within 1e-5 relative, unscanned and scanned;
- greedy KV-cached generate: each new token is transformers' forward argmax (but at a
  near-tie);
- written back by to_hf: from_pretrained reads the same logits;
- exported with a random non-default norm_eps (GPT-2 too): every norm module of
  transformers' model of the written folder has it, whatever the family's key.

Relative error is max |ours - transformers| / max |transformers|.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import param_shapes  # noqa: E402
from jaxformer import ConfigError, ModelConfig, Transformer, count_params  # noqa: E402
from jaxformer.convert import (config_from_hf, config_to_hf, from_hf, read_hf_config,  # noqa: E402
                               to_hf)
from jaxformer.convert.hf_config import differences  # noqa: E402
from jaxformer.decode import generate  # noqa: E402
from tests.conftest import assert_greedy_up_to_near_ties  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
W = 4  # every window: shorter than the 12-token prompt
FAMILIES = {  # model_type: its config.json keys beyond COMMON
    "llama": dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16)),
    "mistral": dict(sliding_window=W),
    "qwen2": dict(use_sliding_window=True, sliding_window=W, max_window_layers=2),
    "qwen3": dict(head_dim=32, use_sliding_window=True, sliding_window=W, max_window_layers=2,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    "gemma": dict(head_dim=32),
    "gemma2": dict(head_dim=32, sliding_window=W, query_pre_attn_scalar=24,
                   attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=32, sliding_window=W, sliding_window_pattern=2,
                        query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0,
                                                                rope_theta=1e6),
                                         "sliding_attention": dict(rope_type="default",
                                                                   rope_theta=1e4)}),
    "olmo2": dict(rope_parameters=dict(rope_type="default", rope_theta=5e5)),
    "olmo3": dict(sliding_window=W),
    "phi3": dict(sliding_window=W, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                        partial_rotary_factor=0.5)),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=W),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.1, logits_scaling=2.0),
    "cohere2": dict(sliding_window=W, sliding_window_pattern=2, logit_scale=0.5),
    "exaone4": dict(sliding_window=W, sliding_window_pattern=2),
    "gpt_neox": dict(num_key_value_heads=None, use_parallel_residual=True,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                          partial_rotary_factor=0.25)),
}


def hf_model(model_type):
    kw = {**COMMON, **FAMILIES[model_type]}
    if kw["num_key_value_heads"] is None:
        kw.pop("num_key_value_heads")
    return random_hf_model(transformers.AutoConfig.for_model(model_type, **kw),
                           int(rng.integers(1 << 31)))


def random_hf_model(config, seed: int):
    """transformers' model of `config` with weights of std 0.1 (wider than its init) and
    norm weights perturbed, drawn from torch's generator at `seed`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    redraw(model.named_parameters(), lambda name: "norm" in name)
    return model


def redraw(named, is_norm):
    """Weights of std 0.1 in place of each (name, tensor) of `named` (wider than
    transformers' init, so differences show); a norm's (is_norm(name)) perturbed by 0.1."""
    with torch.no_grad():
        for name, p in named:
            if is_norm(name):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))


def transformer_lens_bridge(folder, vocab: int):
    """TransformerLens 4's TransformerBridge booted offline from an HF folder (a word-level
    tokenizer of `vocab` tokens saved beside it), weights unprocessed."""
    import tokenizers
    from transformer_lens.model_bridge import TransformerBridge
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="t0",
                                         pad_token="t0").save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(
        str(folder), hf_model=transformers.AutoModelForCausalLM.from_pretrained(folder))
    bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    return bridge


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())

def read_both_ways(folder, prompts, want, *label):
    """from_hf unscanned, then scanned: each gives `want` (transformers' logits) within 1e-5
    relative; the scanned (cfg, params)."""
    for scan in (False, True):
        cfg, params = from_hf(folder, scan_layers=scan)
        got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, prompts))
        assert rel_err(got, want) < 1e-5, (*label, scan, rel_err(got, want))
    return cfg, params



@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_matches_transformers(model_type, tmp_path):
    model = hf_model(model_type)
    model.save_pretrained(tmp_path / "hf")
    prompts = rng.integers(0, 128, (2, 12))
    want = hf_logits(model, prompts)
    cfg, params = read_both_ways(tmp_path / "hf", prompts, want, model_type)
    if any(k.window for k in cfg.kinds):  # the windows bind: without them, another answer
        free = cfg.replace(layer_kinds={n: dict(k.__dict__, window=None) for n, k in
                                        cfg.layer_kinds}) if cfg.layer_pattern else \
            cfg.replace(sliding_window=None)
        assert rel_err(np.asarray(Transformer(free).apply({"params": params}, prompts)),
                       want) > 1e-3

    new = np.asarray(generate(Transformer(cfg), params, prompts, max_new_tokens=8,
                              rng=jax.random.key(0), temperature=0).tokens)
    logits = hf_logits(model, np.concatenate([prompts, new], 1))[:, 11:-1]  # [2, 8, V]
    assert_greedy_up_to_near_ties(new, logits)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert rel_err(hf_logits(back, prompts), want) < 1e-5


def norm_epsilons(model) -> dict:
    """Each norm module of a transformers model -> its epsilon, as the module names it."""
    out = {}
    for name, m in model.named_modules():
        if "Norm" in type(m).__name__:
            keys = [k for k in ("variance_epsilon", "eps", "epsilon") if hasattr(m, k)]
            out[name] = getattr(m, keys[0]) if keys else "no epsilon attribute"
    return out


@pytest.mark.parametrize("model_type", ["gpt2", *FAMILIES])
def test_export_writes_norm_eps_where_transformers_reads_it(model_type, tmp_path):
    """to_hf of a model with a random norm_eps (not the family's default): transformers'
    model of the written config.json has it in every norm, and read_hf_config reads it."""
    kw = {**COMMON, **FAMILIES.get(model_type, {})}
    if kw["num_key_value_heads"] is None:
        kw.pop("num_key_value_heads")
    eps = float(10 ** rng.uniform(-4, -2))
    cfg = config_from_hf(transformers.AutoConfig.for_model(model_type, **kw).to_dict())
    cfg = cfg.replace(norm_eps=eps)
    params = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(x.dtype),
                          param_shapes(cfg))
    assert to_hf(cfg, params, tmp_path)["model_type"] == model_type
    assert read_hf_config(tmp_path).norm_eps == eps
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path))
    found = norm_epsilons(model)
    assert found and all(v == eps for v in found.values()), (eps, found)


@pytest.mark.parametrize("preset", ["gemma3-1b", "qwen3-0.6b", "olmo2-1b", "pythia-160m"])
def test_presets_count_what_transformers_counts(preset):
    cfg = ModelConfig.preset(preset)
    hf = config_to_hf(cfg)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                                  if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert differences(cfg, config_from_hf(hf)) == []  # and it reads back as the same model


@pytest.mark.parametrize("config, words", [
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),  # no text_config
     ["'gemma3'", "text_config", "gemma3_text"]),
    (dict(model_type="phimoe", architectures=["PhimoeForCausalLM"]),
     ["'phimoe'", "mixture of experts"]),
    (dict(COMMON, model_type="gemma3_text", use_bidirectional_attention=True),
     ["use_bidirectional_attention=True", "gemma3_text", "causal"]),
    (dict(COMMON, model_type="phi3", rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                                          short_factor=[1.0], long_factor=[1.0])),
     ["rope_type='longrope'"]),
    (dict(COMMON, model_type="olmo2", hidden_act="relu"), ["hidden_act='relu'", "olmo2"]),
    (dict(COMMON, model_type="qwen3", attention_bias=True), ["attention_bias=True", "qwen3"]),
])
def test_unsupported_options_name_the_key_and_the_family(config, words):
    with pytest.raises(ConfigError) as e:
        config_from_hf(config)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
