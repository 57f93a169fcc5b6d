"""The bart family (jaxformer.hf.bart, and the decoding settings of its
generation_config.json: jaxformer.hf.generation) against transformers' BartForConditionalGeneration:
random tiny models with weights of std 0.1 (the position tables, final_logits_bias and
norms included), read by from_hf, give transformers' float32 logits on padded batches
within 1e-5 relative and its greedy tokens; to_hf writes a folder transformers reads back
as the same model. The tiny config turns off what makes HF's generate more than greedy
(forced_bos_token_id, forced_eos_token_id: None; no_repeat_ngram_size, min_length: 0)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="the interop extra")

from jaxformer.convert import from_hf, generation_constraints, to_hf  # noqa: E402
from jaxformer.decode.constraints import Constraints  # noqa: E402
from jaxformer.decode.seq2seq import seq2seq_generate  # noqa: E402
from jaxformer.model.encoder_decoder import EncoderDecoder  # noqa: E402
from tests.hf.seq2seq_parity import check_family, hf_greedy, hf_logits, padded_batch  # noqa: E402
from tests.hf.test_families import redraw  # noqa: E402

torch.set_num_threads(2)
rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
V, S, T, D = 64, 12, 7, 32  # vocab, source and target lengths, width
PAD, EOS, START = 1, 2, 2  # BART's pad, eos and decoder start (= eos) tokens
VARIANTS = {"scaled-tied": dict(scale_embedding=True, tie_word_embeddings=True,
                                activation_function="gelu"),
            "untied": dict(scale_embedding=False, tie_word_embeddings=False,
                           activation_function="relu")}


def random_bart(variant: str):
    """A tiny BART (2 encoder, 3 decoder layers), plain greedy generation; "untied" with
    its own LM head (transformers 5 ties it unless it differs)."""
    config = transformers.BartConfig(
        vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=16, dropout=0.0, pad_token_id=PAD, bos_token_id=0,
        eos_token_id=EOS, decoder_start_token_id=START, forced_bos_token_id=None,
        forced_eos_token_id=None, no_repeat_ngram_size=0, min_length=0, **VARIANTS[variant])
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        if variant == "untied":
            model.lm_head.weight = torch.nn.Parameter(torch.empty(V, D))
            model.config.tie_word_embeddings = False
    redraw([*model.named_parameters(), *model.named_buffers()],
           lambda name: "layer_norm" in name or "layernorm" in name)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bart_matches_transformers_and_round_trips(variant, tmp_path):
    """Logits of a padded batch: from_hf's within 1e-5 relative of transformers'; greedy
    tokens equal model.generate(do_sample=False)'s; to_hf's folder, read by transformers,
    gives the same logits."""
    model = random_bart(variant)
    gen = model.generation_config  # plain greedy (the module's docstring)
    assert gen.forced_eos_token_id is None and gen.forced_bos_token_id is None
    assert not gen.no_repeat_ngram_size and not gen.min_length
    batch = padded_batch(rng, V, S, T, pad=PAD, start=START, low=3)
    cfg = check_family(model, tmp_path, batch, pad=PAD, start=START, eos=EOS)
    assert cfg.arch == "encoder_decoder" and cfg.block == "post_ln" and cfg.embed_norm
    assert cfg.tie_embeddings == (variant == "scaled-tied")


@pytest.mark.parametrize("key, other", [("decoder_ffn_dim", "encoder_ffn_dim"),
                                        ("decoder_attention_heads", "encoder_attention_heads")])
def test_stacks_of_differing_widths_or_heads_are_refused_in_one_line(key, other):
    """jaxformer's encoder and decoder share d_ff and n_heads: a BART config.json whose
    stacks differ in one is refused in one line naming both keys."""
    from jaxformer import ConfigError
    from jaxformer.convert import config_from_hf
    hf = transformers.BartConfig(vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=4, decoder_attention_heads=4,
                                 encoder_ffn_dim=48, decoder_ffn_dim=48).to_dict()
    hf[key] = {"decoder_ffn_dim": 64, "decoder_attention_heads": 2}[key]
    with pytest.raises(ConfigError, match=f"{key}=.*{other}") as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_constrained_greedy_matches_transformers_generate(tmp_path):
    """BART's summarisers decode under the constraints of their generation_config.json (a
    forced first and last token, no repeated bigram, a minimum length): seq2seq_generate
    under generation_constraints of the folder gives transformers' greedy tokens, with the
    model as drawn (long targets: the bigram ban and the last token) and with EOS's bias
    raised (short ones: the minimum length)."""
    model = random_bart("untied")
    model.generation_config.update(forced_bos_token_id=0, forced_eos_token_id=EOS,
                                   no_repeat_ngram_size=2, min_length=6)
    batches = [padded_batch(rng, V, S, T, pad=PAD, start=START, low=3) for _ in range(4)]
    source, mask = (np.concatenate([b[i] for b in batches]) for i in (0, 1))
    new = 12
    for eos_bias in (0.0, 3.0):
        with torch.no_grad():
            model.final_logits_bias[0, EOS] += eos_bias
        _, theirs = hf_greedy(model, source, mask, new, PAD)
        folder = tmp_path / str(eos_bias)
        model.save_pretrained(folder)
        cfg, params = from_hf(folder)
        c = generation_constraints(folder, cfg)
        assert c == Constraints(min_new_tokens=5, no_repeat_ngram_size=2, forced_bos_id=0,
                                forced_eos_id=EOS)
        ours = seq2seq_generate(EncoderDecoder(cfg), params, source, bos_id=START, eos_id=EOS,
                                pad_id=PAD, max_new_tokens=new, source_lengths=mask.sum(1),
                                constraints=c)
        np.testing.assert_array_equal(np.asarray(ours.tokens), theirs)


def test_scanned_import_matches_transformers_and_exports(tmp_path):
    """from_hf(scan_layers=True): each stack's layers stacked under encoder/blocks and
    decoder/blocks in layer order (2 and 3 of them), and the scanned model gives
    transformers' logits of a padded batch within 1e-5 relative; to_hf of the stacked
    params writes a folder transformers reads back as the same model."""
    model = random_bart("untied")
    model.save_pretrained(tmp_path / "hf")
    source, mask, target = padded_batch(rng, V, S, T, pad=PAD, start=START, low=3)
    want = hf_logits(model, source, mask, target)
    scale = np.abs(want).max()
    cfg, params = from_hf(tmp_path / "hf", scan_layers=True)
    assert cfg.scan_layers
    theirs = dict(model.named_parameters())
    for stack, n in (("encoder", 2), ("decoder", 3)):  # HF's q_proj [out, in] per layer
        q = np.stack([theirs[f"model.{stack}.layers.{i}.self_attn.q_proj.weight"].detach()
                      .numpy().T.reshape(D, 4, D // 4) for i in range(n)])
        np.testing.assert_array_equal(params[stack]["blocks"]["attn"]["query"]["kernel"], q)
    got = np.asarray(jax.jit(EncoderDecoder(cfg).apply)({"params": params}, source, target,
                                                       source_segment_ids=mask))
    assert np.abs(got - want).max() / scale < 1e-5
    to_hf(cfg, params, tmp_path / "out")
    back = type(model).from_pretrained(tmp_path / "out").eval()
    assert np.abs(hf_logits(back, source, mask, target) - want).max() / scale < 1e-5
