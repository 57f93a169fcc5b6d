"""The t5 family (jaxformer.hf.t5) against transformers' T5ForConditionalGeneration, v1.0
(relu, the head tied and the output scaled by d_model ** -0.5) and v1.1 (gated-gelu, a
head of its own, no scale): random tiny models with weights of std 0.1 and their norms
perturbed, read by from_hf, give transformers' float32 logits on padded batches within
1e-5 relative and its greedy tokens; to_hf writes a folder transformers reads back as the
same model. Also the FFNs gelu (erf) and gelu_new (tanh), and config.json files written by
transformers 4 (no scale_decoder_outputs: the output scale follows the tied head)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

import jax  # noqa: E402

from jaxformer.convert import from_hf, to_hf  # noqa: E402
from jaxformer.model.encoder_decoder import EncoderDecoder  # noqa: E402
from tests.hf.seq2seq_parity import check_family, hf_logits, padded_batch  # noqa: E402
from tests.hf.test_families import redraw  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, S, T = 64, 12, 7  # vocab, source and target lengths
VERSIONS = {"v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
            "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def random_t5(version: str, **changes):
    """A tiny T5 (2 encoder, 3 decoder layers; buckets that reach their log range within
    S tokens); v1.1 with its own LM head (transformers 5 ties it unless it differs);
    `changes`: T5Config keys on top of the version's."""
    config = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
        num_decoder_layers=3, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, layer_norm_epsilon=float(rng.uniform(1e-6, 1e-3)),
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        **{**VERSIONS[version], **changes})
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        if version == "v1.1":
            model.lm_head.weight = torch.nn.Parameter(torch.empty(V, 32))
            model.config.tie_word_embeddings = False
    redraw(model.named_parameters(), lambda name: "layer_norm" in name)
    return model


@pytest.mark.parametrize("version", list(VERSIONS))
def test_t5_matches_transformers_and_round_trips(version, tmp_path):
    """Logits of a padded batch: from_hf's within 1e-5 relative of transformers'; greedy
    tokens equal model.generate(do_sample=False)'s; to_hf's folder, read by transformers,
    gives the same logits."""
    model = random_t5(version)
    batch = padded_batch(rng, V, S, T, pad=0, start=0, low=2)
    # transformers' generate: use_cache=False (its cache holds 2 layers here, not 3)
    cfg = check_family(model, tmp_path, batch, pad=0, start=0, eos=1, use_cache=False)
    assert cfg.arch == "encoder_decoder" and cfg.ffn == {"v1.0": "relu", "v1.1": "geglu"}[version]
    assert cfg.tie_embeddings == (version == "v1.0") != cfg.tie_source_embed


@pytest.mark.parametrize("feed_forward_proj, ffn", [("gelu", "gelu_exact"),
                                                    ("gelu_new", "gelu")])
def test_t5_gelu_ffns_match_transformers(feed_forward_proj, ffn, tmp_path):
    """feed_forward_proj gelu is transformers' ACT2FN["gelu"] (erf, jaxformer's gelu_exact)
    and gelu_new its tanh approximation (jaxformer's gelu): from_hf's logits within 1e-5
    relative of transformers' (the two GELUs differ by about 2e-4 of them here), its greedy
    tokens, and to_hf's folder read back by transformers."""
    model = random_t5("v1.0", feed_forward_proj=feed_forward_proj)
    batch = padded_batch(rng, V, S, T, pad=0, start=0, low=2)
    cfg = check_family(model, tmp_path, batch, pad=0, start=0, eos=1, use_cache=False)
    assert cfg.ffn == ffn


@pytest.mark.parametrize("tie", [True, False, None])
def test_a_transformers_4_config_scales_the_output_as_its_head_is_tied(tie, tmp_path):
    """A config.json as transformers 4 wrote it, without scale_decoder_outputs: the output
    is scaled by d_model ** -0.5 when tie_word_embeddings is true or absent (v1.0's files)
    and not when it is false (v1.1's); from_hf's logits of a padded batch within 1e-5
    relative of transformers' model (which reads the edited folder as the same model)."""
    model = random_t5("v1.1" if tie is False else "v1.0")
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    del hf["scale_decoder_outputs"]
    if tie is None:
        del hf["tie_word_embeddings"]
    hf["transformers_version"] = "4.46.3"
    path.write_text(json.dumps(hf))
    source, mask, target = padded_batch(rng, V, S, T, pad=0, start=0, low=2)
    want = hf_logits(model, source, mask, target)
    scale = np.abs(want).max()
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert np.abs(hf_logits(again, source, mask, target) - want).max() / scale < 1e-5
    cfg, params = from_hf(tmp_path)
    got = np.asarray(jax.jit(EncoderDecoder(cfg).apply)({"params": params}, source, target,
                                                        source_segment_ids=mask))
    assert np.abs(got - want).max() / scale < 1e-5
    assert cfg.tie_embeddings == (tie is not False)


def test_the_one_input_table_gets_both_stacks_gradients(tmp_path):
    """T5 v1.1 (FLAN-T5's shape: one input table, a head of its own) read by from_hf has one
    input table, as transformers': the gradient of a loss on the logits of a padded batch
    reaches it from the encoder and the decoder, equal to transformers' gradient of
    shared.weight within 1e-5 relative (a second source table would take the encoder's
    part: fine-tuned, the two would drift apart)."""
    import jax.numpy as jnp

    model = random_t5("v1.1")
    source, mask, target = padded_batch(rng, V, S, T, pad=0, start=0, low=2)
    w = rng.normal(size=(2, T, V)).astype(np.float32)
    out = model(input_ids=torch.tensor(source), attention_mask=torch.tensor(mask),
                decoder_input_ids=torch.tensor(target)).logits
    (out * torch.tensor(w)).sum().backward()
    want = model.shared.weight.grad.numpy()
    model.save_pretrained(tmp_path)
    cfg, params = from_hf(tmp_path)
    assert "source_embed" not in params

    def loss(p):
        logits = EncoderDecoder(cfg).apply({"params": p}, source, target,
                                           source_segment_ids=mask)
        return jnp.sum(w * logits)
    got = np.asarray(jax.grad(loss)(params)["embed"]["embedding"])
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def test_source_and_target_tables_of_their_own_are_refused_in_one_line(tmp_path):
    """T5 has one input table: an untied model with source and target tables of its own
    (tie_source_embed false) cannot be written as T5, and says so in one line."""
    from jaxformer import ConfigError, ModelConfig
    cfg = ModelConfig(arch="encoder_decoder", encoder_layers=1, n_layers=1, vocab_size=V,
                      d_model=16, n_heads=2, d_ff=24, position="t5",
                      position_settings={"num_buckets": 8, "max_distance": 20},
                      norm="rmsnorm", norm_eps=1e-6, ffn="geglu",
                      use_bias=False, attn_scale=1.0, tie_embeddings=False, max_seq_len=32)
    tokens = np.zeros((1, 4), np.int32)
    params = EncoderDecoder(cfg).init(jax.random.key(int(rng.integers(1 << 31))), tokens)
    with pytest.raises(ConfigError, match="tie_source_embed=False cannot be written") as e:
        to_hf(cfg, params["params"], tmp_path)
    assert "\n" not in str(e.value)
