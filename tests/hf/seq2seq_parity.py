"""What the encoder-decoder families' tests share (tests/hf/test_t5.py, test_bart.py): a
padded batch, transformers' logits of it, and the three checks every family passes."""

import jax
import numpy as np
import torch

from jaxformer.convert import from_hf, to_hf
from jaxformer.decode.seq2seq import seq2seq_generate
from jaxformer.model.encoder_decoder import EncoderDecoder


def padded_batch(rng, vocab, source_len, target_len, *, pad, start, low):
    """Source [2, S] of ids in [low, vocab) with the second row padded (mask 0), target
    [2, T] starting with the decoder's start token."""
    source = rng.integers(low, vocab, (2, source_len))
    mask = np.ones((2, source_len), np.int64)
    mask[1, int(rng.integers(4, source_len - 1)):] = 0
    source[mask == 0] = pad
    target = np.concatenate([np.full((2, 1), start),
                             rng.integers(low, vocab, (2, target_len - 1))], 1)
    return source, mask, target


def hf_logits(model, source, mask, target):
    with torch.no_grad():
        return model(input_ids=torch.tensor(source), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(target)).logits.numpy()


def hf_greedy(model, source, mask, new, pad, **generate):
    """transformers' greedy generate on a padded batch: (its first tokens [B], the new
    tokens after them [B, new], padded after every row's EOS as ours)."""
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.tensor(source),
                                attention_mask=torch.tensor(mask), do_sample=False,
                                num_beams=1, max_new_tokens=new, **generate).numpy()
    return theirs[:, 0], np.pad(theirs[:, 1:], ((0, 0), (0, new + 1 - theirs.shape[1])),
                                constant_values=pad)


def check_family(model, folder, batch, *, pad, start, eos, new=6, **generate):
    """The transformers `model` saved and read by from_hf: its logits on `batch` within
    1e-5 relative of transformers'; its greedy tokens (seq2seq_generate) equal
    model.generate(do_sample=False, **generate)'s; to_hf's folder, read back by
    transformers, gives the same logits. Returns from_hf's config."""
    source, mask, target = batch
    model.save_pretrained(folder / "hf")
    want = hf_logits(model, source, mask, target)
    scale = np.abs(want).max()
    cfg, params = from_hf(folder / "hf")
    s2s = EncoderDecoder(cfg)
    got = np.asarray(jax.jit(s2s.apply)({"params": params}, source, target,
                                        source_segment_ids=mask))
    err = np.abs(got - want).max() / scale
    assert err < 1e-5, f"from_hf's logits differ from transformers' by {err:.2e} of their largest"

    first, theirs = hf_greedy(model, source, mask, new, pad, min_new_tokens=0, **generate)
    assert (first == start).all()
    ours = seq2seq_generate(s2s, params, source, bos_id=start, eos_id=eos, pad_id=pad,
                            max_new_tokens=new, source_lengths=mask.sum(1))
    np.testing.assert_array_equal(np.asarray(ours.tokens), theirs)

    written = to_hf(cfg, params, folder / "out")
    assert written["model_type"] == model.config.model_type
    assert written["architectures"] == [type(model).__name__]
    back = type(model).from_pretrained(folder / "out").eval()
    assert np.abs(hf_logits(back, source, mask, target) - want).max() / scale < 1e-5
    return cfg
