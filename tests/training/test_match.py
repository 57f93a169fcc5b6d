"""Task rewards on token ids (jaxformer.training.match) against the Python rule on decoded
text (jaxformer.training.rewards.first_line): random completions of random tokens around
random targets, through a byte tokenizer and a byte-level BPE."""

import numpy as np
import pytest

from jaxformer.data.tokenizer import ByteTokenizer, train_bpe
from jaxformer.training.match import byte_table, encode_targets, task_rewards, token_pieces
from jaxformer.training.rewards import first_line

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
ALPHABET = ["1", "23", "4", "+", "=", " ", "\t", "\n", "\r", "\x0b", "é", "字", "\xa0", "x"]


def text(n):
    return "".join(rng.choice(ALPHABET, n))


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(iter(["12+34=46 hello wörld 字字 \n\t 99 1 23 4"] * 20), 300)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_the_rule_on_token_ids_is_the_rule_on_decoded_text(kind, bpe):
    tok = ByteTokenizer() if kind == "bytes" else bpe
    pieces = token_pieces(tok)
    table, lengths = byte_table(pieces)
    ids = rng.integers(0, tok.vocab_size, (40, 6))
    assert all(b"".join(pieces[i] for i in row).decode("utf-8", "replace") == tok.decode(row)
               for row in ids.tolist())
    n, m = 400, 24
    targets, rows, counts = [], np.zeros((n, m), np.int32), np.zeros(n, np.int32)
    for i in range(n):
        target = first_line(text(rng.integers(0, 4)))
        pad = lambda: "".join(rng.choice([" ", "\t", "\r", ""], rng.integers(0, 3)))  # noqa
        tail = "\n" + text(rng.integers(0, 4)) if rng.random() < 0.5 else ""
        body = target if rng.random() < 0.6 else text(rng.integers(0, 4))
        seq = tok.encode(pad() + body + pad() + tail).tolist()
        if tok.eot_id is not None and rng.random() < 0.5:
            seq.append(tok.eot_id)
        seq = seq[:m]
        counts[i] = len(seq)
        rows[i] = seq + rng.integers(0, tok.vocab_size, m - len(seq)).tolist()  # ignored
        targets.append(target if rng.random() < 0.9 else None)
    target, target_len = encode_targets(targets)
    got = np.asarray(task_rewards(rows, counts, table, lengths, tok.eot_id, target, target_len))

    def decoded(row, count):
        row = row[:count].tolist()
        return tok.decode(row[:-1] if row and row[-1] == tok.eot_id else row)
    want = np.array([float(t is not None and first_line(decoded(r, c)) == t)
                     for r, c, t in zip(rows, counts, targets)])
    np.testing.assert_array_equal(got, want)
    assert 50 < want.sum() < n - 50  # both outcomes, often


def test_a_tokenizer_whose_decode_is_not_concatenation_has_no_table():
    class Plain:
        vocab_size, eot_id, fingerprint = 10, None, "other"
    assert token_pieces(Plain()) is None
