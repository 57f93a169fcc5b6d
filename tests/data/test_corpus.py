"""The default corpus and pieces (jaxformer.data.corpus) against the files' whole text."""

import pathlib
import sysconfig

import numpy as np
import pytest

from jaxformer.data import DataConfig, load_dataset, stdlib_corpus, train_bpe
from jaxformer.data import dataset as dataset_module
from jaxformer.data import tokenizer_kinds
from jaxformer.data.corpus import find_corpus, read_pieces
from tests.data.helpers import random_lines, random_text, reference_val, small_pieces, utf8


# ---- the default corpus -----------------------------------------------------------------

@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("stdlib_cache"))


def test_stdlib_corpus_excludes_site_packages():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    expected = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                      if not skip & set(p.relative_to(root).parts[:-1])
                      and not any(s.startswith(".") for s in p.relative_to(root).parts))
    corpus = stdlib_corpus()
    assert list(corpus.files) == expected and len(expected) > 100
    assert "argparse.py" in corpus.files and "json/decoder.py" in corpus.files


def test_stdlib_dataset_deterministic_split(stdlib_cache):
    cfg = DataConfig(cache_dir=stdlib_cache)
    a, b = load_dataset(cfg, vocab_size=256), load_dataset(cfg, vocab_size=256)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val_docs, b.val_docs)
    corpus = stdlib_corpus()
    root = corpus.root
    val = reference_val(list(corpus.files), 0.05)
    texts = {k: pathlib.Path(root, k).read_bytes().decode("utf-8", "replace").encode()
             for k in corpus.files}
    val_stream = b"".join(texts[k] for k in sorted(val))
    assert bytes(np.asarray(a.val, np.uint8)) == val_stream  # exactly the val files, in order
    assert len(a.train) == sum(len(t) for t in texts.values()) - len(val_stream)
    assert len(a.train_docs) == sum(1 for k in corpus.files if k not in val and texts[k])
    assert a.source.startswith(f"python stdlib {root} ({len(corpus.files)} files")


def test_warm_stdlib_load_reads_only_the_cache(stdlib_cache, monkeypatch):
    """A second load maps the cached tokens: no document is read and nothing is tokenised
    (its speed is bench/ material, not a test's)."""
    cold = load_dataset(DataConfig(cache_dir=stdlib_cache))  # cold unless an earlier test ran

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm load read or tokenised the corpus")

    monkeypatch.setattr(tokenizer_kinds, "read_pieces", forbidden)  # the BPE sample's reads
    monkeypatch.setattr(dataset_module, "write_tokens", forbidden)
    warm = load_dataset(DataConfig(cache_dir=stdlib_cache))
    for split in ("train", "val", "train_docs", "val_docs"):
        np.testing.assert_array_equal(getattr(warm, split), getattr(cold, split))


# ---- text of any size: pieces, memory, speed's plumbing ------------------------------------

def test_a_file_read_in_pieces_tokenises_as_the_whole_file(rng, tmp_path, monkeypatch):
    """A multi-MB file is read in blocks and tokenised a batch of pieces at a time: with
    bytes the stream is exactly the whole file's (decoded with replacement: a character
    that straddles two blocks stays whole, stray invalid bytes become U+FFFD); with BPE
    it decodes back to the file, and equals the whole file's encoding where the cuts
    fall at line ends between visible ASCII characters (a fifth of the text, in pieces
    and batches a fifth as large: as many cuts and batches, a fifth of BPE's work)."""
    piece = int(rng.integers(20_000, 60_000))
    small_pieces(monkeypatch, piece=piece, batch=150_000)
    text = random_lines(rng, int(rng.integers(1_300_000, 1_600_000)))
    raw = bytearray(text.encode("utf-8"))
    for at in rng.choice(len(raw), 50, replace=False):  # invalid bytes, mid-character too
        raw[at] = int(rng.choice([0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF]))
    (tmp_path / "big.txt").write_bytes(bytes(raw))
    assert len(raw) > 2e6
    whole = bytes(raw).decode("utf-8", "replace")
    corpus = find_corpus(str(tmp_path / "big.txt"))
    pieces = list(read_pieces(corpus))
    assert len(pieces) > 20 and "".join(p.text for p in pieces) == whole
    assert [p.end for p in pieces] == [False] * (len(pieces) - 1) + [True]

    vf = float(rng.uniform(0.02, 0.2))
    ds = load_dataset(DataConfig(path=str(tmp_path / "big.txt"), val_fraction=vf,
                                 cache_dir=str(tmp_path / "c")))
    expected = np.frombuffer(whole.encode("utf-8"), np.uint8)
    cut = len(expected) - max(1, int(vf * len(expected) + 0.5))
    np.testing.assert_array_equal(ds.train, expected[:cut])
    np.testing.assert_array_equal(ds.val, expected[cut:])

    tok = train_bpe(iter([text[:200_000]]), 400)
    tok.save(tmp_path / "tok")
    text = text[:len(text) // 5]
    small_pieces(monkeypatch, piece=piece // 5, batch=150_000 // 5)
    (tmp_path / "clean.txt").write_text(text, encoding="utf-8")
    assert len(list(read_pieces(find_corpus(str(tmp_path / "clean.txt"))))) > 20
    ds = load_dataset(DataConfig(path=str(tmp_path / "clean.txt"), val_fraction=0.0,
                                 tokenizer=str(tmp_path / "tok"), cache_dir=str(tmp_path / "c")))
    ids = ds.train[:-1].tolist()  # a list: decode reads a memory map an element at a time
    assert tok.decode(ids) == text and ds.train[-1] == tok.eot_id
    np.testing.assert_array_equal(ids, tok.encode(text))


def test_a_file_that_ends_inside_a_character_reads_as_python_decodes_it(rng, tmp_path,
                                                                        monkeypatch):
    """A file cut off inside a 2- to 4-byte character reads as Python's
    bytes.decode('utf-8', 'replace') of the whole file: a U+FFFD at the end (the
    incremental decoder's final flush), whatever the block size, a block boundary just
    before or inside the truncated character included (and a first block too small for
    the first character is no reason to call the file binary); its byte tokens are that
    text's."""
    def char(n_bytes):  # a random character of n_bytes in UTF-8
        lo, hi = {2: (0x80, 0x7FF), 3: (0x800, 0xD7FF), 4: (0x10000, 0x10FFFF)}[n_bytes]
        return chr(int(rng.integers(lo, hi + 1)))

    # it starts with a 3- or 4-byte character too: a tiny first block holds part of it
    text = char(int(rng.integers(3, 5))) + random_text(rng, int(rng.integers(100, 400)))
    last = char(int(rng.integers(2, 5))).encode("utf-8")
    kept = int(rng.integers(1, len(last)))  # 1 .. len - 1 of its bytes
    raw = text.encode("utf-8") + last[:kept]
    (tmp_path / "cut.txt").write_bytes(raw)
    whole = raw.decode("utf-8", "replace")
    assert whole == text + "\ufffd"
    corpus = find_corpus(str(tmp_path / "cut.txt"))
    start = len(raw) - kept  # where the truncated character begins
    # a block boundary just before the truncated character, inside it (when 2 or 3 of its
    # bytes are there), anywhere (small blocks), and no boundary at all (None: the default)
    for block in [start, start + 1] + list(range(2, 41)) + [None]:
        pieces = list(read_pieces(corpus, piece_chars=block))
        assert "".join(p.text for p in pieces) == whole, block
        assert [p.end for p in pieces] == [False] * (len(pieces) - 1) + [True], block
        assert sum(p.size for p in pieces) == len(raw), block
    small_pieces(monkeypatch, piece=int(rng.integers(2, 40)), batch=64)
    ds = load_dataset(DataConfig(path=str(tmp_path / "cut.txt"), val_fraction=0.0,
                                 cache_dir=str(tmp_path / "c")))
    assert ds.train.tolist() == utf8(whole) and len(ds.val) == 0


def test_pieces_end_only_at_newlines_between_visible_ascii(rng, tmp_path, monkeypatch):
    """Most lines here start with whitespace (indentation, a tab, a no-break space) or a
    non-ASCII character, or follow a line that ends with one. A file read in small pieces
    still gives a BPE the tokens of its whole text encoded at once (a cut before an
    indented line, or after trailing spaces, would not: GPT-2's pre-tokenizer keeps a
    newline with the spaces around it), because a piece ends only after a newline
    between two visible ASCII characters (corpus.cut_point), and the pieces join to the
    text exactly."""
    leads = ["    ", "  ", " ", "\t", "\u00a0", "\u00e9", "\u4e2d", "\u2014", "\U0001F600",
             "\u03a9"]
    trails = [" ", "  ", "\t", "\u00e9", "\u4e2d", "\U0001F600"]

    def ascii_char():
        return chr(int(rng.integers(0x21, 0x7F)))

    lines = []
    for _ in range(int(rng.integers(150, 250))):  # blocks of at most ~110 characters
        first, last = [ascii_char()], []
        for _ in range(int(rng.integers(1, 5))):  # no clean cut inside a block
            if rng.random() < 0.6:  # the next line starts with a lead
                first.append(str(rng.choice(leads)))
                last.append(str(rng.choice(trails)) if rng.random() < 0.3 else ascii_char())
            else:  # or this one ends with a trail
                first.append(ascii_char())
                last.append(str(rng.choice(trails)))
        last.append(ascii_char())  # a clean cut before the next block
        lines += [f + random_text(rng, int(rng.integers(0, 16))).replace("\n", " ") + e
                  for f, e in zip(first, last)]
    text = "\n".join(lines)
    (tmp_path / "code.txt").write_text(text, encoding="utf-8")
    # 1,000 tokens, so that the merges of whitespace with a newline are learned (with 400, a
    # cut after trailing spaces changed the tokens at as few as 1 of 50 such lines)
    tok = train_bpe(iter([text]), 1000)
    tok.save(tmp_path / "tok")
    whole = tok.encode(text).tolist()
    # the test can tell: a cut before an indented line, or after trailing spaces, changes
    # the tokens (somewhere among the first 50 such lines; at 15 or more of them on 40 seeds)
    newlines = [i for i, c in enumerate(text) if c == "\n"]
    for around in (+1, -1):
        cuts = [i + 1 for i in newlines if text[i + around] in " \t"][:50]
        assert any(tok.encode(text[:i]).tolist() + tok.encode(text[i:]).tolist() != whole
                   for i in cuts), around

    piece = int(rng.integers(300, 500))
    small_pieces(monkeypatch, piece=piece, batch=3 * piece)
    ds = load_dataset(DataConfig(path=str(tmp_path / "code.txt"), val_fraction=0.0,
                                 tokenizer=str(tmp_path / "tok"), cache_dir=str(tmp_path / "c")))
    assert ds.train[:-1].tolist() == whole and ds.train[-1] == tok.eot_id

    pieces = list(read_pieces(find_corpus(str(tmp_path / "code.txt"))))
    assert len(pieces) > 10 and "".join(p.text for p in pieces) == text

    for a, b in zip(pieces, pieces[1:]):
        assert a.text[-1] == "\n" and "!" <= a.text[-2] <= "~" and "!" <= b.text[0] <= "~", \
            (a.text[-20:], b.text[:20])
