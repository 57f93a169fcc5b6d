"""The t5 family (jaxformer.hf.t5) against transformers' T5ForConditionalGeneration, v1.0
(relu, the head tied and the output scaled by d_model ** -0.5) and v1.1 (gated-gelu, a
head of its own, no scale): random tiny models with weights of std 0.1 and their norms
perturbed, read by from_hf, give transformers' float32 logits on padded batches within
1e-5 relative and its greedy tokens; to_hf writes a folder transformers reads back as the
same model."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer.convert import from_hf, to_hf  # noqa: E402
from jaxformer.seq2seq_decoding import seq2seq_generate  # noqa: E402
from jaxformer.seq2seq_model import EncoderDecoder  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, S, T = 64, 12, 7  # vocab, source and target lengths
VERSIONS = {"v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
            "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def random_t5(version: str):
    """A tiny T5 (2 encoder, 3 decoder layers; buckets that reach their log range within
    S tokens); v1.1 with its own LM head (transformers 5 ties it unless it differs)."""
    config = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
        num_decoder_layers=3, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, layer_norm_epsilon=float(rng.uniform(1e-6, 1e-3)),
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        **VERSIONS[version])
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        if version == "v1.1":
            model.lm_head.weight = torch.nn.Parameter(torch.empty(V, 32))
            model.config.tie_word_embeddings = False
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def padded_batch():
    """Source [2, S] with the second row padded (mask 0), target [2, T] starting with the
    decoder start token 0."""
    source = rng.integers(2, V, (2, S))
    mask = np.ones((2, S), np.int64)
    mask[1, int(rng.integers(4, S - 1)):] = 0
    source[mask == 0] = 0
    target = np.concatenate([np.zeros((2, 1), np.int64), rng.integers(2, V, (2, T - 1))], 1)
    return source, mask, target


def hf_logits(model, source, mask, target):
    with torch.no_grad():
        return model(input_ids=torch.tensor(source), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(target)).logits.numpy()


@pytest.mark.parametrize("version", list(VERSIONS))
def test_t5_matches_transformers_and_round_trips(version, tmp_path):
    """Logits of a padded batch: from_hf's within 1e-5 relative of transformers'; greedy
    tokens equal model.generate(do_sample=False)'s; to_hf's folder, read by transformers,
    gives the same logits."""
    model = random_t5(version)
    model.save_pretrained(tmp_path / "hf")
    source, mask, target = padded_batch()
    want = hf_logits(model, source, mask, target)
    scale = np.abs(want).max()

    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.arch == "encoder_decoder" and cfg.ffn == {"v1.0": "relu", "v1.1": "geglu"}[version]
    assert cfg.tie_embeddings == (version == "v1.0")
    s2s = EncoderDecoder(cfg)
    got = np.asarray(jax.jit(s2s.apply)({"params": params}, source, target,
                                        source_segment_ids=mask))
    assert np.abs(got - want).max() / scale < 1e-5

    new = 6
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.tensor(source),
                                attention_mask=torch.tensor(mask), do_sample=False,
                                max_new_tokens=new, min_new_tokens=0,
                                use_cache=False).numpy()[:, 1:]  # its cache: 2 layers, not 3
    theirs = np.pad(theirs, ((0, 0), (0, new - theirs.shape[1])))  # pad 0 after both EOS
    ours = seq2seq_generate(s2s, params, source, bos_id=0, eos_id=1, pad_id=0,
                            max_new_tokens=new, source_lengths=mask.sum(1))
    np.testing.assert_array_equal(np.asarray(ours.tokens), theirs)

    written = to_hf(cfg, params, tmp_path / "out")
    assert written["model_type"] == "t5"
    assert written["architectures"] == ["T5ForConditionalGeneration"]
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert np.abs(hf_logits(back, source, mask, target) - want).max() / scale < 1e-5


def test_differing_source_and_target_tables_are_refused_in_one_line(tmp_path):
    """T5 has one input table: an untied model whose source_embed and embed differ cannot
    be written as T5, and says so in one line."""
    from jaxformer import ConfigError, ModelConfig
    cfg = ModelConfig(arch="encoder_decoder", encoder_layers=1, n_layers=1, vocab_size=V,
                      d_model=16, n_heads=2, d_ff=24, position="t5", t5_num_buckets=8,
                      t5_max_distance=20, norm="rmsnorm", norm_eps=1e-6, ffn="geglu",
                      use_bias=False, attn_scale=1.0, tie_embeddings=False, max_seq_len=32)
    tokens = np.zeros((1, 4), np.int32)
    params = EncoderDecoder(cfg).init(jax.random.key(int(rng.integers(1 << 31))), tokens)
    with pytest.raises(ConfigError, match="tie_embeddings.*shared.weight") as e:
        to_hf(cfg, params["params"], tmp_path)
    assert "\n" not in str(e.value)
