"""The tokenizers (jaxformer.data.tokenizer): round trips against the text and its bytes."""

import numpy as np

from jaxformer.data import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from tests.data.helpers import EOT, random_text, utf8


# ---- tokenizers -----------------------------------------------------------------------

def test_byte_tokenizer_round_trip(rng, tmp_path):
    tok = ByteTokenizer()
    text = random_text(rng, 2000)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == utf8(text)
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, 65, 0xE4, 0xB8]) == "\ufffdA\ufffd"  # invalid UTF-8 is replaced
    assert tok.vocab_size == 256 and tok.eot_id is None
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), ByteTokenizer)


def test_bpe_train_round_trip_save_load(rng, tmp_path):
    words = [random_text(rng, int(rng.integers(2, 6))) for _ in range(40)]
    corpus = [" ".join(rng.choice(words, 200)) for _ in range(20)]
    tok = train_bpe(iter(corpus), 400)
    assert isinstance(tok, HFTokenizer) and 257 < tok.vocab_size <= 400
    assert tok.eot_id is not None and tok.hf.token_to_id(EOT) == tok.eot_id
    assert tok.decode([tok.eot_id]) == EOT
    assert len(tok.encode(corpus[0])) < len(corpus[0].encode()) / 2  # merges were learned
    unseen = random_text(rng, 3000) + " " + EOT + " \t\n  x"
    ids = tok.encode(unseen)
    assert tok.decode(ids) == unseen
    assert tok.eot_id not in ids.tolist()  # a literal <|endoftext|> in text is just text
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer) and loaded.fingerprint == tok.fingerprint
    assert loaded.vocab_size == tok.vocab_size and loaded.eot_id == tok.eot_id
    for text in corpus[:3] + [unseen]:
        np.testing.assert_array_equal(loaded.encode(text), tok.encode(text))
