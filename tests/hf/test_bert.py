"""The bert family (jaxformer.hf.bert) against transformers' BertForMaskedLM: a random tiny
model with weights of std 0.1 and its LayerNorms perturbed, read by from_hf, gives
transformers' float32 logits on a padded batch within 1e-5 relative; to_hf writes a folder
that transformers reads back as the same model."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer import Transformer  # noqa: E402
from jaxformer.convert import from_hf, to_hf  # noqa: E402
from tests.hf.test_families import redraw  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def random_bert(act: str):
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=24, hidden_act=act, pad_token_id=None,
        layer_norm_eps=float(rng.uniform(1e-6, 1e-3)))
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.BertForMaskedLM(config).eval()
    redraw(model.named_parameters(), lambda name: "LayerNorm" in name)
    return model


def masked_lm_logits(model, tokens, attention_mask):
    with torch.no_grad():
        return model(torch.tensor(tokens), attention_mask=torch.tensor(attention_mask)
                     ).logits.numpy()


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_matches_transformers_and_round_trips(act, tmp_path):
    """Logits of the real (non-padding) tokens of a right-padded batch: from_hf's within
    1e-5 relative of transformers'; to_hf's folder, read by transformers, likewise."""
    model = random_bert(act)
    model.save_pretrained(tmp_path / "hf")
    tokens = rng.integers(0, 96, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, int(rng.integers(5, 11)):] = 0
    want = masked_lm_logits(model, tokens, mask)
    real = mask > 0
    scale = np.abs(want[real]).max()

    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.arch == "encoder" and cfg.ffn == {"gelu": "gelu_exact", "gelu_new": "gelu"}[act]
    got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens,
                                                     segment_ids=mask))
    assert np.abs(got - want)[real].max() / scale < 1e-5

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == "bert" and written["architectures"] == ["BertForMaskedLM"]
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    assert np.abs(masked_lm_logits(back, tokens, mask) - want)[real].max() / scale < 1e-5


def test_a_bare_bert_model_is_refused_in_one_line(tmp_path):
    """BertModel has no masked-LM head to read: refused by its architecture, in one line."""
    from jaxformer import ConfigError
    model = random_bert("gelu")
    model.bert.save_pretrained(tmp_path / "bare")
    with pytest.raises(ConfigError, match="unsupported architecture.*BertModel.*BertForMaskedLM"
                       ) as e:
        from_hf(tmp_path / "bare")
    assert "\n" not in str(e.value)
