"""Tests for jaxformer.data against plain-Python/NumPy references, on fresh random data."""

import hashlib
import json
import os
import pathlib
import sysconfig

import numpy as np
import pytest

from jaxformer.config import ConfigError
from jaxformer.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    HFTokenizer,
    eval_batches,
    get_batch,
    load_dataset,
    load_tokenizer,
    stdlib_corpus,
    train_bpe,
)
from jaxformer.data import corpus as corpus_module
from jaxformer.data import dataset as dataset_module
from jaxformer.data import tokenizer as tokenizer_module
from jaxformer.data import tokens as tokens_module
from jaxformer.data.corpus import find_corpus, read_pieces
from jaxformer.data.sources import SOURCES, Source

EOT = "<|endoftext|>"
# ASCII (weighted), Latin-1, Greek, CJK, emoji: 1- to 4-byte UTF-8
_RANGES = [(0x20, 0x7E)] * 6 + [(0x0A, 0x0A), (0xA0, 0xFF), (0x391, 0x3C9), (0x4E00, 0x4E80),
                                 (0x1F600, 0x1F640)]


def random_text(rng, n: int) -> str:
    lo_hi = [_RANGES[i] for i in rng.integers(0, len(_RANGES), n)]
    return "".join(chr(int(rng.integers(lo, hi + 1))) for lo, hi in lo_hi)


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def reference_val(keys, val_fraction):
    """Plain restatement of the split rule: the round-half-up(fraction * n) keys (at least
    1, at most n - 1) with the smallest sha256 go to val."""
    n_val = min(max(1, int(val_fraction * len(keys) + 0.5)), len(keys) - 1)
    ranked = sorted(keys, key=lambda k: (hashlib.sha256(k.encode()).digest(), k))
    return set(ranked[:n_val])


def offsets(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths))]


def files_in(folder):
    root = pathlib.Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


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


# ---- DataConfig ---------------------------------------------------------------------------

def test_data_config_validation():
    cfg = DataConfig.from_dict({"path": "x.txt", "tokenizer": "bpe", "pack": True})
    assert cfg.path == "x.txt" and cfg.pack and cfg.replace(pack=False).pack is False
    with pytest.raises(ConfigError, match="unknown data field.*shuffle.*valid fields are: path"):
        DataConfig.from_dict({"shuffle": True})
    with pytest.raises(ConfigError, match="data.tokenizer='byts' is not one of bytes, bpe"):
        DataConfig(tokenizer="byts")
    with pytest.raises(ConfigError, match="data.bin_dtype='int8' is not one of uint16, uint32"):
        DataConfig(bin_dtype="int8")
    with pytest.raises(ConfigError, match="data.val_fraction=1.0 must be < 1"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ConfigError, match="data.bpe_vocab_size=100 must be >= 257"):
        DataConfig(bpe_vocab_size=100)
    with pytest.raises(ConfigError, match="data.pack=1 must be true or false"):
        DataConfig(pack=1)


# ---- each form of data.path -----------------------------------------------------------

def test_text_file_split_by_tokens(rng, tmp_path):
    text = random_text(rng, int(rng.integers(500, 3000)))
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    vf = float(rng.uniform(0.05, 0.5))
    ds = load_dataset(DataConfig(path=str(tmp_path / "input.txt"), val_fraction=vf,
                                 cache_dir=str(tmp_path / "cache")), vocab_size=256)
    expected = utf8(text)
    n_val = int(vf * len(expected) + 0.5)
    assert ds.train.tolist() == expected[:len(expected) - n_val]
    assert ds.val.tolist() == expected[len(expected) - n_val:]
    assert ds.train_docs.tolist() == [0] and ds.val_docs.tolist() == [0]
    assert isinstance(ds.train, np.memmap) and not ds.train.flags.writeable
    assert ds.train.dtype == np.uint8 and ds.train_docs.dtype == np.int64
    assert "input.txt" in ds.source
    # a tie rounds half up: 10 tokens x 0.25 = 2.5 -> 3 val tokens
    (tmp_path / "ten.txt").write_text("0123456789")
    ds = load_dataset(DataConfig(path=str(tmp_path / "ten.txt"), val_fraction=0.25,
                                 cache_dir=str(tmp_path / "cache")))
    assert bytes(np.asarray(ds.val, np.uint8)) == b"789"


def test_folder_split_by_file(rng, tmp_path):
    root = tmp_path / "corpus"
    texts = {}
    for i in range(int(rng.integers(8, 20))):
        rel = f"{'sub/' if i % 3 == 0 else ''}{'deep/' if i % 5 == 0 else ''}f{i}" \
              f"{['.txt', '.md', '.py'][i % 3]}"
        texts[rel] = random_text(rng, int(rng.integers(1, 300)))
    texts["empty.txt"] = ""  # counted by the split, skipped in the stream
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for ignored in ("notes.json", "__pycache__/x.py", ".git/y.txt", "sub/.hidden.txt"):
        (root / ignored).parent.mkdir(parents=True, exist_ok=True)
        (root / ignored).write_text("IGNORED")
    vf = float(rng.uniform(0.1, 0.4))
    ds = load_dataset(DataConfig(path=str(root), val_fraction=vf, cache_dir=str(tmp_path / "c")))
    keys = sorted(texts)
    val = reference_val(keys, vf)
    assert len(val) == int(vf * len(keys) + 0.5)
    for split, arr, docs in (("train", ds.train, ds.train_docs), ("val", ds.val, ds.val_docs)):
        chosen = [k for k in keys if (k in val) == (split == "val") and texts[k]]
        assert arr.tolist() == sum((utf8(texts[k]) for k in chosen), []), split
        assert docs.tolist() == offsets([len(utf8(texts[k])) for k in chosen]), split
    assert f"({len(keys)} files" in ds.source


def test_jsonl_split_by_record(rng, tmp_path):
    n_records = int(rng.integers(10, 30))
    records = [random_text(rng, int(rng.integers(1, 100))) for _ in range(n_records)]
    lines, keys = [], []
    for text in records:
        if rng.random() < 0.2:
            lines.append("   ")  # blank lines are not records
        lines.append(json.dumps({"id": len(keys), "body": text, "text": "not this"}))
        keys.append(f"data.jsonl:{len(lines)}")
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    vf = float(rng.uniform(0.1, 0.3))
    ds = load_dataset(DataConfig(path=str(tmp_path / "data.jsonl"), text_field="body",
                                 val_fraction=vf, cache_dir=str(tmp_path / "c")))
    val = reference_val(keys, vf)
    for split, arr, docs in (("train", ds.train, ds.train_docs), ("val", ds.val, ds.val_docs)):
        chosen = [t for k, t in zip(keys, records) if (k in val) == (split == "val")]
        assert arr.tolist() == sum((utf8(t) for t in chosen), [])
        assert docs.tolist() == offsets([len(utf8(t)) for t in chosen])


def test_bpe_dataset_trains_on_train_split_and_appends_eot(rng, tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    names = sorted([f"doc{i}.txt" for i in range(10)] + ["empty.txt"])
    val = reference_val(names, 0.2)
    texts = {n: ("" if n == "empty.txt" else "qzxv" * 2000 if n in val else
                 " ".join(random_text(rng, 4) for _ in range(300))) for n in names}
    for n, t in texts.items():
        (root / n).write_text(t, encoding="utf-8")
    run_dir = tmp_path / "run"
    cfg = DataConfig(path=str(root), tokenizer="bpe", bpe_vocab_size=600, val_fraction=0.2,
                     cache_dir=str(tmp_path / "c"))
    ds = load_dataset(cfg, run_dir=str(run_dir))
    tok = ds.tokenizer
    assert len(tok.encode("qzxvqzxv")) >= 4  # the val-only string was never merged
    train = [n for n in names if n not in val and texts[n]]  # empty documents are skipped
    expected = [tok.encode(texts[n]).tolist() + [tok.eot_id] for n in train]
    assert ds.train.tolist() == sum(expected, [])
    assert ds.train_docs.tolist() == offsets([len(e) for e in expected])
    assert ds.val.tolist() == sum((tok.encode(texts[n]).tolist() + [tok.eot_id]
                                   for n in sorted(val) if texts[n]), [])
    assert load_tokenizer(run_dir).fingerprint == tok.fingerprint
    # resuming in the same run dir reuses its tokenizer
    assert load_dataset(cfg, run_dir=str(run_dir)).tokenizer.fingerprint == tok.fingerprint
    # and a different tokenizer setting for that run dir is refused
    with pytest.raises(DataError, match="tokenizer.json holds HFTokenizer.*continue the run"):
        load_dataset(cfg.replace(tokenizer="bytes"), run_dir=str(run_dir))


def _wordlevel_tokenizer(tmp_path, n_words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {EOT: 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, n_words)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([EOT])
    path = tmp_path / "wordlevel.json"
    path.write_text(hf.to_str())
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_file_split_by_tokens(rng, tmp_path, dtype):
    n = int(rng.integers(1000, 5000))
    vf = float(rng.uniform(0.05, 0.5))
    cut = n - int(vf * n + 0.5)
    if dtype == "uint16":  # byte ids, no separator: one document
        ids, tokenizer, eot = rng.integers(0, 256, n), "bytes", None
    else:  # ids past 65535, documents end at eot (id 0)
        ids, eot = rng.integers(1, 70_000, n), 0
        ids[rng.random(n) < 0.02] = eot
        ids[[cut - 1, n - 1]] = eot  # documents end exactly at the ends of both splits
        tokenizer = str(_wordlevel_tokenizer(tmp_path, 70_000))
    ids.astype(dtype).tofile(tmp_path / "tokens.bin")
    ds = load_dataset(DataConfig(path=str(tmp_path / "tokens.bin"), bin_dtype=dtype,
                                 tokenizer=tokenizer, val_fraction=vf), vocab_size=70_000)
    assert ds.train.dtype == np.dtype(dtype) and isinstance(ds.train, np.memmap)
    assert ds.train.tolist() == ids[:cut].tolist() and ds.val.tolist() == ids[cut:].tolist()
    for part, docs in ((ids[:cut].tolist(), ds.train_docs), (ids[cut:].tolist(), ds.val_docs)):
        starts = [0] + [i + 1 for i, t in enumerate(part) if t == eot and i + 1 < len(part)]
        assert docs.tolist() == starts


def test_bin_folder_train_and_val(rng, tmp_path):
    train, val = rng.integers(0, 256, 3000), rng.integers(0, 256, 500)
    train.astype(np.uint16).tofile(tmp_path / "train.bin")
    val.astype(np.uint16).tofile(tmp_path / "val.bin")
    ds = load_dataset(DataConfig(path=str(tmp_path)))
    assert ds.train.tolist() == train.tolist() and ds.val.tolist() == val.tolist()
    assert ds.train_docs.tolist() == [0] and ds.val_docs.tolist() == [0]
    assert "train.bin" in files_in(tmp_path) and len(files_in(tmp_path)) == 2  # nothing cached


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


# ---- the cache ----------------------------------------------------------------------------

def _folder(rng, root, n=5):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i}.txt").write_text(random_text(rng, 200), encoding="utf-8")
    return root


def test_cache_is_reused_and_written_atomically(rng, tmp_path, monkeypatch):
    root, cache = _folder(rng, tmp_path / "corpus"), tmp_path / "cache"
    cfg = DataConfig(path=str(root), cache_dir=str(cache), val_fraction=0.2)
    first = load_dataset(cfg)
    assert [p.split("/")[0] for p in files_in(cache)] == [os.listdir(cache)[0]] * 5
    assert not any("tmp" in p for p in files_in(cache))

    def fail(*args, **kwargs):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(tokenizer_module.ByteTokenizer, "encode", fail)
    monkeypatch.setattr(tokenizer_module.ByteTokenizer, "encode_batch", fail)
    again = load_dataset(cfg)
    np.testing.assert_array_equal(first.train, again.train)
    np.testing.assert_array_equal(first.val, again.val)

    # a changed source file is a new cache entry; a failure while writing it leaves nothing
    (root / "f0.txt").write_text("changed", encoding="utf-8")
    with pytest.raises(AssertionError, match="re-tokenized"):
        load_dataset(cfg)
    assert len(os.listdir(cache)) == 1 and not any("tmp" in p for p in files_in(cache))
    monkeypatch.undo()
    changed = load_dataset(cfg)
    assert len(os.listdir(cache)) == 2 and not any("tmp" in p for p in files_in(cache))
    assert b"changed" in bytes(np.concatenate([changed.train, changed.val]).astype(np.uint8))


def killed_writer(final: str) -> tuple[str, int]:
    """The temporary folder of `final` that a writer killed with SIGKILL left behind
    (a child process makes it, writes half a file, and is killed), and its pid."""
    import signal
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from jaxformer.data.tokens import temporary_path\n"
        f"tmp = temporary_path({final!r}); os.makedirs(tmp)\n"
        "open(os.path.join(tmp, 'train.bin'), 'wb').write(b'half')\n"
        "print(tmp, flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    dead = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    return dead, child.pid


def test_killed_tokenisation_leaves_a_folder_the_next_run_removes(rng, tmp_path, capsys):
    """A writer killed with SIGKILL leaves its temporary folder; the next load removes it,
    and keeps a live process's folder and another host's."""
    import socket
    cache, final = tmp_path / "cache", str(tmp_path / "cache" / "tokens-abc")
    dead, pid = killed_writer(final)
    assert os.path.isdir(dead)
    host = socket.gethostname()
    live = f"{final}.tmp-{host}-{os.getpid()}-{rng.bytes(4).hex()}"
    other = f"{final}.tmp-not-{host}-{pid}-{rng.bytes(4).hex()}"
    for folder in (live, other):
        os.makedirs(folder)
    (tmp_path / "hi.txt").write_text("hello, world")
    load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), cache_dir=str(cache)))
    assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isdir(other)
    assert f"data: removed {dead}, left by process {pid}, which is gone" in \
        capsys.readouterr().err


# ---- text of any size: pieces, memory, speed's plumbing ------------------------------------

def random_lines(rng, n_chars: int) -> str:
    """Lines of random 1- to 4-byte characters (fast: drawn as arrays), each between two
    ASCII letters, so that a line end is a clean cut (see corpus.cut_point)."""
    lo, hi = np.array(_RANGES).T
    which = rng.integers(0, len(_RANGES), n_chars)
    cps = lo[which] + (rng.random(n_chars) * (hi[which] - lo[which] + 1)).astype(np.int64)
    body = "".join(map(chr, cps.tolist())).replace("\n", " ")
    ends = np.cumsum(rng.integers(1, 300, n_chars // 40))
    ends = ends[ends < len(body)]
    return "\n".join(f"a{body[i:j]}z" for i, j in zip(np.r_[0, ends], np.r_[ends, len(body)]))


def small_pieces(monkeypatch, piece: int, batch: int):
    monkeypatch.setattr(corpus_module, "PIECE_CHARS", piece)
    monkeypatch.setattr(tokens_module, "BATCH_CHARS", batch)


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
    tok = train_bpe(iter([text]), 400)
    tok.save(tmp_path / "tok")
    whole = tok.encode(text).tolist()
    # the test can tell: a cut before an indented line, or after trailing spaces, changes
    # the tokens (somewhere among the first 50 such lines)
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


_RSS_CHILD = """
import sys
from jaxformer.data import DataConfig, corpus, load_dataset, tokens
corpus.PIECE_CHARS, tokens.BATCH_CHARS = int(sys.argv[4]), int(sys.argv[5])
ds = load_dataset(DataConfig(path=sys.argv[1], tokenizer=sys.argv[2], cache_dir=sys.argv[3]),
                  progress=False, log=lambda m: None)
assert len(ds.train) > 0
# the peak RSS of this program: ru_maxrss would also count the pytest process it was forked
# from (Linux keeps the larger across exec)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_peak_memory_stays_flat_as_the_file_grows(rng, tmp_path):
    """Peak RSS of a fresh process tokenising a file 4x as large grows by less than half
    the extra text with bytes (default pieces), and by less than the extra text with a
    BPE tokenizer.json (small pieces: its allocator's working set creeps up by a few MB
    before it settles). Whole files used to be read and encoded at once: 11x the file
    with bytes, ~100x with BPE."""
    import subprocess
    import sys
    block = random_lines(rng, 500_000).encode("utf-8")
    tok = train_bpe(iter([block[:200_000].decode("utf-8", "replace")]), 300)
    tok.save(tmp_path / "tok")
    for tokenizer, small, piece, batch, share in (("bytes", 8e6, 1 << 19, 4 << 20, 0.5),
                                                  (str(tmp_path / "tok"), 3e6, 1 << 14,
                                                   1 << 16, 1.0)):
        peak = []
        for size in (small, 4 * small):
            path = tmp_path / f"{int(size)}.txt"
            path.write_bytes(block * int(size // len(block) + 1))
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), tokenizer,
                                  str(tmp_path / "cache"), str(piece), str(batch)],
                                 capture_output=True, text=True, check=True).stdout
            peak.append(int(out.split()[-1]) * 1024)
        extra = os.path.getsize(tmp_path / f"{int(4 * small)}.txt") - \
            os.path.getsize(tmp_path / f"{int(small)}.txt")
        assert peak[1] - peak[0] < share * extra, (tokenizer, peak, extra)


def test_bpe_trains_on_a_bounded_sample_spread_over_the_train_split(rng, tmp_path):
    """data.bpe_train_bytes bounds the text BPE is trained on; the sample is drawn from
    the whole train split (its start, middle and end), never from val, and the run log
    says how much it used. A single document's sample stops before its val tail."""
    from jaxformer.data.dataset import _BpeSample
    n = int(rng.integers(60, 120))
    docs = [f"doc{i:03d} " + random_text(rng, int(rng.integers(200, 400))) for i in range(n)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    budget = int(rng.integers(5_000, 12_000))
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), val_fraction=0.2, bpe_train_bytes=budget)

    class Bar:
        def update(self, n):
            pass

    sample = _BpeSample(cfg, find_corpus(cfg.path))
    taken = list(sample.texts(Bar()))
    val = reference_val([f"d.jsonl:{i}" for i in range(1, n + 1)], 0.2)
    val_texts = {docs[int(k.split(":")[1]) - 1] for k in val}
    assert not set(taken) & val_texts
    assert budget / 2 < sum(map(len, taken)) == sample.taken <= budget
    index = sorted(int(t[3:6]) for t in taken)
    assert index[0] < n / 4 and index[-1] >= 3 * n / 4, index  # spread, not a prefix
    assert max(np.diff(index)) < n / 3, index

    logged = []
    load_dataset(cfg.replace(tokenizer="bpe", bpe_vocab_size=300, cache_dir=str(tmp_path / "c")),
                 run_dir=str(tmp_path / "run"), log=logged.append)
    assert any("sampled from the" in m and f"data.bpe_train_bytes={budget:,}" in m
               for m in logged), logged

    body = random_lines(rng, 20_000)
    (tmp_path / "one.txt").write_text(body + "\n" + "Q" * 2000)  # Q only in the val tail
    one = DataConfig(path=str(tmp_path / "one.txt"), val_fraction=0.1, bpe_train_bytes=10**9)
    taken = "".join(_BpeSample(one, find_corpus(one.path)).texts(Bar()))
    assert "Q" not in taken and body.startswith(taken)


def test_progress_bars_and_one_line_on_a_cache_hit(rng, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tokens_module, "BAR_DELAY", 0)
    (tmp_path / "t.txt").write_text(random_lines(rng, 50_000), encoding="utf-8")
    cfg = DataConfig(path=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "c"))
    logged = []
    load_dataset(cfg, progress=False, log=logged.append)
    assert "data: tokenising" not in capsys.readouterr().err
    assert len(logged) == 1 and logged[0].startswith("data: tokenised text file")
    load_dataset(cfg.replace(val_fraction=0.1), log=logged.append)
    assert "data: tokenising" in capsys.readouterr().err  # tqdm: MB, MB/s and ETA
    load_dataset(cfg, log=logged.append)
    assert len(logged) == 3 and logged[2].startswith("data: tokens from the cache, ")


def test_not_enough_disk_is_refused_before_tokenising_much(rng, tmp_path, monkeypatch):
    import collections
    small_pieces(monkeypatch, piece=20_000, batch=60_000)
    (tmp_path / "t.txt").write_text(random_lines(rng, 400_000), encoding="utf-8")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(tokens_module.shutil, "disk_usage", lambda p: usage(10**9, 0, 50_000))
    cache = tmp_path / "c"
    with pytest.raises(DataError, match=r"needs about 0.00\d* GB more in .*c, but 0.00 GB is "
                                         "free; free some space, or set data.cache_dir"):
        load_dataset(DataConfig(path=str(tmp_path / "t.txt"), cache_dir=str(cache)))
    assert os.listdir(cache) == []  # no tokens, no temporary folder


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_disk_estimate_counts_the_token_dtype_bytes(rng, tmp_path, monkeypatch, dtype):
    """The free-space check after the first batch counts tokens in their dtype's bytes (2
    or 4 each, not 1 as for byte tokens): at the first batch's rate, the rest needs
    (tokens so far x itemsize) / (text bytes so far) x (text bytes to come), here by
    hand from word counts (a word-level tokenizer: one token a word, an eot a file). A
    disk with 10% less free than that is refused before the tokens are written; one with
    20% more is used."""
    import collections
    n_words = 70_000 if dtype == "uint32" else int(rng.integers(300, 60_000))
    tokenizer = str(_wordlevel_tokenizer(tmp_path, n_words))
    root = tmp_path / "corpus"
    root.mkdir()
    n_files = int(rng.integers(6, 12))
    counts, sizes = [], []
    for i in range(n_files):
        words = [f"w{w}" for w in rng.integers(2, n_words, int(rng.integers(20, 200)))]
        text = "".join(w + str(rng.choice([" ", "\n", "  "])) for w in words)
        (root / f"d{i:02d}.txt").write_text(text)
        counts.append(len(words) + 1)
        sizes.append(len(text))
    first = int(rng.integers(1, n_files - 1))
    monkeypatch.setattr(tokens_module, "_BATCH_PIECES", first)  # the first batch: `first` files
    need = (sum(counts[:first]) * np.dtype(dtype).itemsize / sum(sizes[:first])
            * sum(sizes[first:]))
    usage = collections.namedtuple("usage", "total used free")
    cache = tmp_path / "c"
    cfg = DataConfig(path=str(root), tokenizer=tokenizer, val_fraction=0.0, cache_dir=str(cache))
    monkeypatch.setattr(tokens_module.shutil, "disk_usage",
                        lambda p: usage(10**12, 0, int(0.9 * need)))
    with pytest.raises(DataError, match=r"needs about \d+\.\d\d GB more in .*c, but \d+\.\d\d GB "
                                         "is free; free some space"):
        load_dataset(cfg)
    assert os.listdir(cache) == []
    monkeypatch.setattr(tokens_module.shutil, "disk_usage",
                        lambda p: usage(10**12, 0, int(1.2 * need) + 1))
    ds = load_dataset(cfg)
    assert ds.train.dtype == np.dtype(dtype) and len(ds.train) == sum(counts)


def test_prepare_writes_a_folder_that_trains_anywhere(rng, tmp_path, capsys):
    """python -m jaxformer.data.prepare: tokens and tokenizer in one folder; data.path=DIR
    maps its files in place (every host the same ones) with its own tokenizer."""
    from jaxformer.data.prepare import main
    records = [random_text(rng, int(rng.integers(50, 300))) for _ in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in records))
    out, cache = tmp_path / "prepared", str(tmp_path / "c")
    args = [f"data.path={tmp_path / 'd.jsonl'}", "data.text_field=body", "data.tokenizer=bpe",
            "data.bpe_vocab_size=300", "data.val_fraction=0.25", f"data.cache_dir={cache}"]
    assert main(args + [f"out={out}"]) == 0
    assert f"train with data.path={out}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "train.bin",
                                       "train_docs.npy", "val.bin", "val_docs.npy"]
    tok = load_tokenizer(out)
    direct = load_dataset(DataConfig(path=str(tmp_path / "d.jsonl"), text_field="body",
                                     val_fraction=0.25, tokenizer=str(out / "tokenizer.json"),
                                     cache_dir=cache))
    for _ in range(2):  # e.g. two hosts
        ds = load_dataset(DataConfig(path=str(out)), run_dir=str(tmp_path / "run"))
        assert ds.tokenizer.fingerprint == tok.fingerprint and ds.source.startswith("prepared")
        assert ds.train.filename == str(out / "train.bin")
        for split in ("train", "val", "train_docs", "val_docs"):
            np.testing.assert_array_equal(getattr(ds, split), getattr(direct, split))
    assert tok.decode(ds.val[ds.val_docs[0]:ds.val_docs[1] - 1]) in records

    assert main(args + [f"out={out}"]) == 2
    assert "already exists; choose a new folder" in capsys.readouterr().err
    assert main(args) == 2 and "out=DIR is missing" in capsys.readouterr().err
    assert main(args + ["train.steps=3", "out=x"]) == 2
    assert "unexpected argument(s) train.steps=3" in capsys.readouterr().err
    ByteTokenizer().save(tmp_path / "other")
    with pytest.raises(DataError, match="was prepared with HFTokenizer.*not with data.tokenizer"):
        load_dataset(DataConfig(path=str(out), tokenizer=str(tmp_path / "other")))


def test_prepare_removes_a_killed_prepares_folder_beside_out(rng, tmp_path, capsys):
    """A prepare killed with SIGKILL leaves its temporary folder beside out; the next
    prepare removes it (as load_dataset does in the cache), keeps a live process's folder
    and another host's, and writes out."""
    import socket
    from jaxformer.data.prepare import main
    out = str(tmp_path / "data" / "tokens")
    dead, pid = killed_writer(out)
    assert os.path.isdir(dead) and os.path.dirname(dead) == os.path.dirname(out)
    host = socket.gethostname()
    live = f"{out}.tmp-{host}-{os.getpid()}-{rng.bytes(4).hex()}"
    other = f"{out}.tmp-not-{host}-{pid}-{rng.bytes(4).hex()}"
    for folder in (live, other):
        os.makedirs(folder)
    text = random_text(rng, int(rng.integers(100, 500)))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert main([f"data.path={tmp_path / 't.txt'}", f"data.cache_dir={tmp_path / 'c'}",
                 f"out={out}"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isdir(other)
    assert sorted(os.listdir(tmp_path / "data")) == sorted(
        os.path.basename(p) for p in (out, live, other))
    ds = load_dataset(DataConfig(path=out, cache_dir=str(tmp_path / "c")))
    assert ds.train.tolist() + ds.val.tolist() == utf8(text)


# ---- errors ---------------------------------------------------------------------------------

def write_parquet(path, columns, row_group_size):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def test_parquet_equals_jsonl_and_splits_by_row(rng, tmp_path, monkeypatch):
    """The same documents as JSONL and as Parquet (several row groups) give the same
    tokens, also when long records are cut into pieces; with a val split, rows are
    documents keyed 'file.parquet:ROW', as JSONL lines are; a folder of Parquet files
    (with a README beside them) reads every file's rows."""
    small_pieces(monkeypatch, piece=int(rng.integers(8, 40)), batch=100)
    records = [random_text(rng, int(rng.integers(1, 80))) for _ in range(int(rng.integers(12, 30)))]
    groups = int(rng.integers(2, 6))
    write_parquet(tmp_path / "data.parquet", {"id": list(range(len(records))), "body": records},
                  groups)
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"body": t}) + "\n" for t in records), encoding="utf-8")
    cache = str(tmp_path / "c")
    both = [load_dataset(DataConfig(path=str(tmp_path / f"data.{ext}"), text_field="body",
                                    val_fraction=0.0, cache_dir=cache))
            for ext in ("jsonl", "parquet")]
    assert both[0].train.tolist() == both[1].train.tolist() == sum(map(utf8, records), [])
    assert both[0].train_docs.tolist() == both[1].train_docs.tolist() == \
        offsets([len(utf8(t)) for t in records])

    cut = int(rng.integers(1, len(records) - 1))
    folder = tmp_path / "folder"
    write_parquet(folder / "a.parquet", {"body": records[:cut]}, groups)
    write_parquet(folder / "b" / "c.parquet", {"body": records[cut:]}, groups)
    (folder / "README.md").write_text("not a document")
    vf = float(rng.uniform(0.1, 0.3))
    for path, keys in ((tmp_path / "data.parquet",
                        [f"data.parquet:{i}" for i in range(1, len(records) + 1)]),
                       (folder, [f"a.parquet:{i}" for i in range(1, cut + 1)] +
                        [f"b/c.parquet:{i}" for i in range(1, len(records) - cut + 1)])):
        ds = load_dataset(DataConfig(path=str(path), text_field="body", val_fraction=vf,
                                     cache_dir=cache))
        val = reference_val(keys, vf)
        for split, arr in (("train", ds.train), ("val", ds.val)):
            chosen = [t for k, t in zip(keys, records) if (k in val) == (split == "val")]
            assert arr.tolist() == sum(map(utf8, chosen), []), (path, split)


def test_bad_parquet_and_non_text_files_are_refused(rng, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    load = lambda name, **kw: load_dataset(DataConfig(  # noqa: E731
        path=str(tmp_path / name), cache_dir=cache, **kw))
    write_parquet(tmp_path / "cols.parquet", {"id": [1, 2], "body": ["a", "b"]}, 1)
    with pytest.raises(DataError, match=r"cols.parquet: no column 'text' \(columns: id, body\); "
                                         "set data.text_field"):
        load("cols.parquet")
    write_parquet(tmp_path / "cell.parquet", {"text": ["ab", "cd", None, "ef"]}, 2)
    with pytest.raises(DataError, match=r"cell.parquet: row 3 \(row group 1, row 0 in it\): "
                                         "column 'text' holds NoneType"):
        load("cell.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + rng.bytes(300))
    with pytest.raises(DataError, match="broken.parquet: not a readable Parquet file"):
        load("broken.parquet")
    with monkeypatch.context() as m:
        m.setitem(__import__("sys").modules, "pyarrow.parquet", None)
        with pytest.raises(DataError, match=r"needs pyarrow: pip install 'jaxformer\[data\]'"):
            load("cols.parquet", text_field="body")

    import gzip
    (tmp_path / "data.txt.gz").write_bytes(gzip.compress(b"hello " * 100))
    (tmp_path / "table.txt").write_bytes((tmp_path / "cols.parquet").read_bytes())
    noisy = bytes(rng.integers(0x80, 0x100, 4000, dtype=np.uint8))  # no NUL, no valid UTF-8
    (tmp_path / "latin.txt").write_bytes(noisy)
    (tmp_path / "nul.txt").write_bytes(b"text\0" * 100)
    for name, what in (("data.txt.gz", "a gzip archive"),
                       ("table.txt", r"a Parquet file \(name it .parquet\)"),
                       ("latin.txt", r"not UTF-8 \(\d+% of it is invalid\)"),
                       ("nul.txt", r"binary \(it holds NUL bytes\)")):
        with pytest.raises(DataError, match=f"{name} is not text: {what}; jaxformer reads text"):
            load(name)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("fine")
    (tmp_path / "docs" / "blob.txt").write_bytes(b"\0\1\2" * 50)
    with pytest.raises(DataError, match=r"blob.txt is not text: binary"):
        load("docs")
    # text in a legacy 8-bit encoding is text (the stdlib has a KOI8-R module)
    (tmp_path / "koi8.txt").write_bytes("Привет, мир! Hello, world.\n".encode("koi8_r") * 20)
    assert len(load("koi8.txt").train) > 0


def test_errors_name_the_problem(rng, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match="nowhere.txt.*does not exist"):
        load_dataset(DataConfig(path=str(tmp_path / "nowhere.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no .txt/.md/.py or .parquet files under .*empty"):
        load_dataset(DataConfig(path=str(tmp_path / "empty")))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        load_dataset(DataConfig(path=str(tmp_path / "bad.jsonl"), cache_dir=cache))
    (tmp_path / "field.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError, match=r"field.jsonl:2: no field 'text' \(fields: body\).*"
                                         "data.text_field"):
        load_dataset(DataConfig(path=str(tmp_path / "field.jsonl"), cache_dir=cache))
    (tmp_path / "hi.txt").write_text("hello, world")
    with pytest.raises(DataError, match=r"token id 119 but model.vocab_size=100"):
        load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), cache_dir=cache), vocab_size=100)
    with pytest.raises(DataError, match=r"tokenizer has 256 ids but model.vocab_size=120"):
        load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), cache_dir=cache), vocab_size=120)
    with pytest.raises(DataError, match="'bpe'.*no run_dir"):
        load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), tokenizer="bpe", cache_dir=cache))
    np.array([5, 300, 7], np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match="token id 300.*tokenizer.*256 ids.*data.tokenizer"):
        load_dataset(DataConfig(path=str(tmp_path / "t.bin")))
    with pytest.raises(DataError, match="no tokenizer at"):
        load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), tokenizer="nope/tokenizer.json"))


def test_an_id_out_of_range_only_in_val_is_refused(rng, tmp_path):
    """An id that does not fit the model (or the tokenizer) in the val split only is
    refused as one in train is: the tail of one .bin file, a folder's val.bin, and the
    val documents of a text corpus (byte tokens: the largest byte of the val files,
    found here by hand, is the id named)."""
    cache = str(tmp_path / "c")
    vocab = int(rng.integers(100, 250))
    n, vf = int(rng.integers(500, 2000)), float(rng.uniform(0.05, 0.3))
    cut = n - int(vf * n + 0.5)
    ids, bad = rng.integers(0, vocab, n), int(rng.integers(vocab, 256))
    ids[rng.integers(cut, n)] = bad
    ids.astype(np.uint16).tofile(tmp_path / "one.bin")
    with pytest.raises(DataError, match=rf"one.bin \(.*\) holds token id {bad} but "
                                        rf"model.vocab_size={vocab} "):
        load_dataset(DataConfig(path=str(tmp_path / "one.bin"), val_fraction=vf,
                                cache_dir=cache), vocab_size=vocab)

    pair = tmp_path / "pair"
    pair.mkdir()
    rng.integers(0, vocab, n).astype(np.uint16).tofile(pair / "train.bin")
    val = rng.integers(0, vocab, int(rng.integers(50, 200)))
    val[rng.integers(0, len(val))] = bad
    val.astype(np.uint16).tofile(pair / "val.bin")
    with pytest.raises(DataError, match=rf"holds token id {bad} but model.vocab_size={vocab} "):
        load_dataset(DataConfig(path=str(pair), cache_dir=cache), vocab_size=vocab)
    big = int(rng.integers(256, 65536))  # past the byte tokenizer's ids
    val[rng.integers(0, len(val))] = big
    val.astype(np.uint16).tofile(pair / "val.bin")
    with pytest.raises(DataError, match=rf"holds token id {big}, but the tokenizer "
                                        r"\(ByteTokenizer\(vocab_size=256\)\) has only 256 ids"):
        load_dataset(DataConfig(path=str(pair), cache_dir=cache))

    root = tmp_path / "corpus"
    root.mkdir()
    names = [f"d{i:02d}.txt" for i in range(int(rng.integers(5, 15)))]
    held_out = reference_val(names, vf)
    texts = {}
    for name in names:  # ASCII in train, any character in val
        texts[name] = random_text(rng, 100) + ("\u00e9" if name in held_out else "")
        if name not in held_out:
            texts[name] = "".join(c if c < "\x7f" else "?" for c in texts[name])
        (root / name).write_text(texts[name], encoding="utf-8")
    top = max(max(utf8(texts[name])) for name in held_out)
    assert top >= 128 > max(max(utf8(texts[name])) for name in names if name not in held_out)
    with pytest.raises(DataError, match=rf"corpus \(.*\) holds token id {top} but "
                                        "model.vocab_size=128 "):
        load_dataset(DataConfig(path=str(root), val_fraction=vf, cache_dir=cache),
                     vocab_size=128)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_bin_id_equal_to_vocab_size_is_refused_and_one_less_fits(rng, tmp_path, dtype):
    """The ids of a model (and of a tokenizer) of V ids are 0 .. V - 1: a .bin whose
    largest id is exactly V is refused, naming V; one whose largest id is V - 1 loads."""
    vocab = int(rng.integers(300, 5000))
    tokenizer = str(_wordlevel_tokenizer(tmp_path, vocab))  # V ids, as many as the model's
    n = int(rng.integers(500, 2000))
    ids, at = rng.integers(0, vocab - 1, n), int(rng.integers(0, n))
    path = tmp_path / "tokens.bin"
    cfg = DataConfig(path=str(path), bin_dtype=dtype, tokenizer=tokenizer,
                     cache_dir=str(tmp_path / "c"))
    ids[at] = vocab
    ids.astype(dtype).tofile(path)
    with pytest.raises(DataError, match=rf"holds token id {vocab} but model.vocab_size={vocab} "
                                        rf".*set model.vocab_size >= {vocab + 1}"):
        load_dataset(cfg, vocab_size=vocab)
    with pytest.raises(DataError, match=rf"holds token id {vocab}, but the tokenizer "
                                        rf"\(.*\) has only {vocab} ids"):
        load_dataset(cfg)
    ids[at] = vocab - 1
    ids.astype(dtype).tofile(path)
    ds = load_dataset(cfg, vocab_size=vocab)
    assert ds.train.tolist() + ds.val.tolist() == ids.tolist()


# ---- the sources table: one entry per kind of corpus ----------------------------------------
# Every entry of SOURCES needs a sample here (a writer of a corpus of its kind); the
# tests below run over the table, so a new entry is tested by being added.

def sample_files(rng, tmp_path):
    """A folder of text files (a .json beside them is not one) -> (path, {key: text})."""
    root, docs = tmp_path / "texts", {}
    for i in range(int(rng.integers(3, 7))):
        rel = f"{'sub/' if i % 2 else ''}d{i}{['.txt', '.md', '.py'][i % 3]}"
        docs[rel] = random_text(rng, int(rng.integers(0 if i == 2 else 1, 200)))
    for rel, text in docs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "notes.json").write_text("{}")
    return str(root), dict(sorted(docs.items()))


def sample_jsonl(rng, tmp_path):
    lines, docs = [], {}
    for _ in range(int(rng.integers(3, 10))):
        if rng.random() < 0.3:
            lines.append("")  # blank lines are not records
        lines.append(json.dumps({"text": random_text(rng, int(rng.integers(0, 150)))}))
        docs[f"d.jsonl:{len(lines)}"] = json.loads(lines[-1])["text"]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(tmp_path / "d.jsonl"), docs


def sample_parquet(rng, tmp_path):
    """A folder of two Parquet files of several row groups, a README beside them."""
    root, docs = tmp_path / "rows", {}
    for rel in ("a.parquet", "b/c.parquet"):
        texts = [random_text(rng, int(rng.integers(0, 150))) for _ in range(rng.integers(2, 8))]
        write_parquet(root / rel, {"n": list(range(len(texts))), "text": texts}, 3)
        docs.update({f"{rel}:{i}": t for i, t in enumerate(texts, 1)})
    (root / "README.md").write_text("not a document")
    return str(root), docs


def eot_starts(ids, eot):
    """Where documents start: 0 and after each eot, not past the end; [] for no ids."""
    return [0] + [i + 1 for i, t in enumerate(ids) if t == eot and i + 1 < len(ids)] \
        if len(ids) else []


def sample_bin(tmp_path, train, val, tokenizer):
    """One .bin file: val is its last val_fraction -> (path, DataConfig fields)."""
    np.asarray(train + val, np.uint16).tofile(tmp_path / "t.bin")
    return str(tmp_path / "t.bin"), dict(tokenizer=tokenizer,
                                         val_fraction=len(val) / (len(train) + len(val)))


def sample_bin_pair(tmp_path, train, val, tokenizer):
    for split, ids in (("train", train), ("val", val)):
        np.asarray(ids, np.uint16).tofile(tmp_path / f"{split}.bin")
    return str(tmp_path), dict(tokenizer=tokenizer)


def sample_prepared(tmp_path, train, val, tokenizer):
    """A token folder as prepare writes it, by hand: its tokenizer comes with it."""
    tok = load_tokenizer(tokenizer)
    tok.save(tmp_path)
    for split, ids in (("train", train), ("val", val)):
        np.asarray(ids, np.uint16).tofile(tmp_path / f"{split}.bin")
        np.save(tmp_path / f"{split}_docs.npy", np.asarray(eot_starts(ids, tok.eot_id), np.int64))
    (tmp_path / "meta.json").write_text(json.dumps(dict(
        dtype="uint16", max_id=max(train + val), train_tokens=len(train), val_tokens=len(val),
        tokenizer=tok.fingerprint)))
    return str(tmp_path), {}


TEXT_SAMPLES = {"files": sample_files, "jsonl": sample_jsonl, "parquet": sample_parquet}
TOKEN_SAMPLES = {"bin": sample_bin, "bin_pair": sample_bin_pair, "prepared": sample_prepared}
TEXT_KINDS = [kind for kind, source in SOURCES.items() if source.holds_text]
TOKEN_KINDS = [kind for kind, source in SOURCES.items() if not source.holds_text]


def sample_of(kind, samples):
    assert kind in samples, (f"SOURCES[{kind!r}] has no sample in tests/test_data.py: add a "
                             "writer of one to TEXT_SAMPLES or TOKEN_SAMPLES")
    return samples[kind]


@pytest.mark.parametrize("kind", list(SOURCES))
def test_every_source_claims_its_sample(kind, rng, tmp_path):
    (tmp_path / "s").mkdir()
    if SOURCES[kind].holds_text:
        path, _ = sample_of(kind, TEXT_SAMPLES)(rng, tmp_path / "s")
    else:
        path, _ = sample_of(kind, TOKEN_SAMPLES)(tmp_path / "s", [1, 2, 0], [3, 0],
                                                 str(_wordlevel_tokenizer(tmp_path, 10)))
    corpus = find_corpus(path)
    assert corpus.kind == kind and corpus.source is SOURCES[kind]


def test_find_corpus_tries_the_sources_in_order(rng, tmp_path):
    """Of the entries that claim a path, the table's first wins, the catch-all ("files")
    last: a prepared folder is not a bin pair, token files are not a dataset folder,
    Parquet in a folder wins over its text files; half a token folder is refused."""
    write_parquet(tmp_path / "p.parquet", {"text": ["a"]}, 1)
    table = pathlib.Path(tmp_path / "p.parquet").read_bytes()

    def folder(name, *files):
        for rel in files:
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_bytes(table if rel.endswith(".parquet") else b"ab")
        return tmp_path / name

    everything = ("a.parquet", "b.txt", "c.md", "d.jsonl", "e.bin")
    for path, kind, label, files in (
            (folder("prep", "train.bin", "val.bin", "meta.json", *everything), "prepared",
             "prepared tokens", ["train.bin", "val.bin"]),
            (folder("pair", "train.bin", "val.bin", *everything), "bin_pair", ".bin token files",
             ["train.bin", "val.bin"]),
            (folder("ds", "z.parquet", "s/y.parquet", "b.txt", "README.md"), "parquet",
             "parquet folder", ["s/y.parquet", "z.parquet"]),
            (folder("txt", "b.txt", "s/c.py", "d.jsonl", "e.bin", "f.json"), "files", "folder",
             ["b.txt", "s/c.py"])):
        corpus = find_corpus(str(path))
        assert (corpus.kind, corpus.label, list(corpus.files)) == (kind, label, files), path
        count = f"{len(files)} files, " if kind in ("parquet", "files") else ""
        assert corpus.describe().startswith(f"{label} {path} ({count}"), corpus.describe()
    for name, kind, label in (("t.bin", "bin", ".bin token file"), ("t.jsonl", "jsonl", "jsonl"),
                              ("t.parquet", "parquet", "parquet"), ("t.txt", "files", "text file"),
                              ("t.csv", "files", "text file"), ("t.bin.txt", "files", "text file"),
                              ("t.txt.jsonl", "jsonl", "jsonl"), ("README", "files", "text file")):
        (tmp_path / name).write_bytes(b"ab")
        corpus = find_corpus(str(tmp_path / name))
        assert (corpus.kind, corpus.label, corpus.files) == (kind, label, (name,))
        assert corpus.describe() == f"{label} {tmp_path / name} (2 B)"
    for name, has, lacks in (("half", "train.bin", "val.bin"), ("other", "val.bin", "train.bin")):
        with pytest.raises(DataError, match=f"{name} holds {has} but not {lacks}; a token "
                                            "folder needs both"):
            find_corpus(str(folder(name, has, "a.parquet", "b.txt")))
    with pytest.raises(DataError, match=r"no .txt/.md/.py or .parquet files under .*none; add"):
        find_corpus(str(folder("none", "a.json", "b.jsonl", ".hidden/c.txt", "__pycache__/d.py")))


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_each_text_source_reads_its_documents_whole_in_pieces(kind, rng, tmp_path, monkeypatch):
    """Every text source's documents, read in pieces of any size, join to each document's
    text, in the order of document_keys; split by document, their byte tokens are their
    UTF-8 (empty documents are counted by the split and skipped in the stream)."""
    path, docs = sample_of(kind, TEXT_SAMPLES)(rng, tmp_path)
    corpus = find_corpus(path)
    assert corpus_module.document_keys(corpus) == list(docs)
    for piece_chars in (None, int(rng.integers(2, 8)), int(rng.integers(8, 64))):
        read, pieces = [], list(read_pieces(corpus, piece_chars=piece_chars))
        for i, piece in enumerate(pieces):
            if i == 0 or pieces[i - 1].end:
                read.append([piece.key, ""])
            assert piece.key == read[-1][0]
            read[-1][1] += piece.text
        assert pieces[-1].end and [tuple(r) for r in read] == list(docs.items()), piece_chars
        assert piece_chars is None or len(pieces) > len(docs)  # long documents were cut

    piece = int(rng.integers(4, 40))
    small_pieces(monkeypatch, piece=piece, batch=3 * piece)
    vf = float(rng.uniform(0.2, 0.5))
    ds = load_dataset(DataConfig(path=path, val_fraction=vf, cache_dir=str(tmp_path / "c")))
    val = reference_val(list(docs), vf)
    for split, arr, starts in (("train", ds.train, ds.train_docs), ("val", ds.val, ds.val_docs)):
        chosen = [t for k, t in docs.items() if (k in val) == (split == "val") and t]
        assert arr.tolist() == sum(map(utf8, chosen), []), split
        assert starts.tolist() == offsets([len(utf8(t)) for t in chosen]), split


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_each_token_source_maps_its_train_and_val_in_place(kind, rng, tmp_path):
    """Every token source's train and val ids are mapped as they are (nothing cached),
    documents starting after each eot; an id out of range only in val is refused; BPE
    is not trained on token ids (a source with its own tokenizer keeps it)."""
    vocab = int(rng.integers(300, 5000))
    tokenizer = str(_wordlevel_tokenizer(tmp_path, vocab))  # eot is id 0
    train, val = (rng.integers(0, vocab, n) for n in rng.integers(50, 300, 2))
    for ids in (train, val):
        ids[rng.random(len(ids)) < 0.05] = 0
    train, val = train.tolist(), val.tolist()
    write = sample_of(kind, TOKEN_SAMPLES)
    (tmp_path / "ok").mkdir()
    path, fields = write(tmp_path / "ok", train, val, tokenizer)
    cfg = DataConfig(path=path, cache_dir=str(tmp_path / "cache"), **fields)
    ds = load_dataset(cfg, run_dir=str(tmp_path / "run"), vocab_size=vocab)
    assert (ds.train.tolist(), ds.val.tolist()) == (train, val)
    assert ds.train_docs.tolist() == eot_starts(train, 0)
    assert ds.val_docs.tolist() == eot_starts(val, 0)
    assert ds.train.filename.startswith(path) and not (tmp_path / "cache").exists()
    assert ds.tokenizer.fingerprint == load_tokenizer(tokenizer).fingerprint

    bpe = cfg.replace(tokenizer="bpe")
    if SOURCES[kind].tokenizer is None:
        with pytest.raises(DataError, match="'bpe' trains on text, but .* holds token ids"):
            load_dataset(bpe, run_dir=str(tmp_path / "run2"))
    else:
        assert load_dataset(bpe, run_dir=str(tmp_path / "run2")).tokenizer.fingerprint == \
            ds.tokenizer.fingerprint

    val[int(rng.integers(0, len(val)))] = vocab
    (tmp_path / "bad").mkdir()
    path, fields = write(tmp_path / "bad", train, val, tokenizer)
    with pytest.raises(DataError, match=rf"holds token id {vocab} but model.vocab_size={vocab} "):
        load_dataset(cfg.replace(path=path, **fields), vocab_size=vocab)


def tsv_keys(corpus):  # one stable name per document, in order: 'docs.tsv:LINE'
    with open(corpus.path_of(corpus.files[0]), "rb") as f:
        return [f"{corpus.files[0]}:{i}" for i, _ in enumerate(f, 1)]


def read_tsv(corpus, text_field, block):  # (key, [(text, bytes read)]) per document
    with open(corpus.path_of(corpus.files[0]), "rb") as f:  # the README's example source
        for i, line in enumerate(f, 1):
            yield f"{corpus.files[0]}:{i}", [(line.decode("utf-8").rstrip("\n"), len(line))]


def test_a_source_added_from_outside_is_found_read_and_split(rng, tmp_path, monkeypatch):
    """A new format is one entry in SOURCES: a .tsv of documents, one per line, is then
    its own kind (before, and after the entry is gone, it is a text file), split by
    document, each document's tokens its UTF-8 (bytes) or its ids then eot."""
    docs = [random_text(rng, int(rng.integers(0, 80))).replace("\n", " ")
            for _ in range(int(rng.integers(5, 15)))]
    path = tmp_path / "docs.tsv"
    path.write_text("".join(d + "\n" for d in docs), encoding="utf-8")
    assert find_corpus(str(path)).kind == "files"
    with monkeypatch.context() as m:
        m.setitem(SOURCES, "tsv", Source(suffix=".tsv", label="tsv", document_keys=tsv_keys,
                                         read=read_tsv))
        corpus = find_corpus(str(path))
        assert (corpus.kind, corpus.source.holds_text) == ("tsv", True)
        assert corpus.describe().startswith(f"tsv {path} (")
        vf = float(rng.uniform(0.2, 0.5))
        keys = [f"docs.tsv:{i}" for i in range(1, len(docs) + 1)]
        ds = load_dataset(DataConfig(path=str(path), val_fraction=vf,
                                     cache_dir=str(tmp_path / "c")))
        val = reference_val(keys, vf)
        for split, arr, starts in (("train", ds.train, ds.train_docs),
                                   ("val", ds.val, ds.val_docs)):
            chosen = [d for k, d in zip(keys, docs) if (k in val) == (split == "val") and d]
            assert arr.tolist() == sum(map(utf8, chosen), []), split
            assert starts.tolist() == offsets([len(utf8(d)) for d in chosen]), split

        words = [[int(w) for w in rng.integers(2, 50, rng.integers(1, 6))] for _ in range(6)]
        (tmp_path / "words.tsv").write_text("".join(" ".join(f"w{w}" for w in ws) + "\n"
                                                    for ws in words))
        ds = load_dataset(DataConfig(path=str(tmp_path / "words.tsv"), val_fraction=0.0,
                                     tokenizer=str(_wordlevel_tokenizer(tmp_path, 50)),
                                     cache_dir=str(tmp_path / "c")))
        assert ds.train.tolist() == sum((ws + [0] for ws in words), [])  # eot is id 0
    assert "tsv" not in SOURCES and find_corpus(str(path)).kind == "files"


# ---- batches ------------------------------------------------------------------------------

def reference_pack(docs, start, seq_len):
    """segment_ids, positions, loss_mask of the window at `start`, one token at a time."""
    def doc_of(p):
        return max(i for i, d in enumerate(docs) if d <= p)
    seg, pos, mask = [], [], []
    for t in range(seq_len):
        p = start + t
        seg.append(doc_of(p) - doc_of(start) + 1)
        pos.append(p - max(docs[doc_of(p)], start))
        mask.append(1.0 if doc_of(p + 1) == doc_of(p) else 0.0)
    return seg, pos, mask


def random_docs(rng, n):
    lengths = rng.integers(1, 20, n)  # many documents of 1 token, many boundaries per window
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), int(lengths.sum())


def test_get_batch_pure_and_real_slices(rng):
    n, B, T = int(rng.integers(500, 2000)), 4, 16
    tokens = np.arange(n, dtype=np.uint32)  # a row's first id is its window start
    seed = int(rng.integers(0, 2**31))
    kw = dict(seed=seed, batch_size=B, seq_len=T)
    b5 = get_batch(tokens, None, step=5, **kw)
    for k in range(5):
        get_batch(tokens, None, step=k, **kw)
    again = get_batch(tokens, None, step=5, **kw)
    assert set(b5) == {"inputs", "targets", "loss_mask"}
    for key in b5:
        np.testing.assert_array_equal(b5[key], again[key])
    assert not np.array_equal(b5["inputs"], get_batch(tokens, None, step=6, **kw)["inputs"])
    other_seed = get_batch(tokens, None, step=5, **{**kw, "seed": seed + 1})
    assert not np.array_equal(b5["inputs"], other_seed["inputs"])
    assert b5["inputs"].dtype == np.int32 and b5["inputs"].shape == (B, T)
    assert b5["loss_mask"].dtype == np.float32 and (b5["loss_mask"] == 1).all()
    for row_in, row_tg in zip(b5["inputs"], b5["targets"]):
        s = int(row_in[0])
        assert 0 <= s <= n - T - 1
        assert row_in.tolist() == tokens[s:s + T].tolist()
        assert row_tg.tolist() == tokens[s + 1:s + T + 1].tolist()
    # every start in [0, n - T - 1] is drawn, none outside
    short = np.arange(T + 3, dtype=np.uint16)
    starts = {int(s) for k in range(60)
              for s in get_batch(short, None, step=k, **kw)["inputs"][:, 0]}
    assert starts == {0, 1, 2}


def test_get_batch_packing_against_reference(rng):
    docs, n = random_docs(rng, 300)
    tokens = rng.integers(0, 256, n).astype(np.uint16)
    kw = dict(seed=int(rng.integers(0, 1000)), step=int(rng.integers(0, 1000)),
              batch_size=6, seq_len=32)
    packed, plain = get_batch(tokens, docs, pack=True, **kw), get_batch(tokens, docs, **kw)
    np.testing.assert_array_equal(packed["inputs"], plain["inputs"])
    np.testing.assert_array_equal(packed["targets"], plain["targets"])
    assert "segment_ids" not in plain and "positions" not in plain
    for key in ("segment_ids", "positions"):
        assert packed[key].dtype == np.int32
    # recover each row's start by matching its tokens (and targets) against the stream
    for b in range(kw["batch_size"]):
        row = packed["inputs"][b].tolist() + [packed["targets"][b, -1]]
        start = next(s for s in range(n - 32) if tokens[s:s + 33].tolist() == row)
        seg, pos, mask = reference_pack(docs.tolist(), start, 32)
        assert packed["segment_ids"][b].tolist() == seg
        assert packed["positions"][b].tolist() == pos
        assert packed["loss_mask"][b].tolist() == mask
    assert packed["loss_mask"].min() == 0 and packed["segment_ids"].max() > 2


def test_eval_batches_deterministic_and_covering(rng):
    docs, n = random_docs(rng, int(rng.integers(100, 200)))
    tokens = rng.integers(0, 256, n).astype(np.uint16)
    B, T = 3, 8
    batches = list(eval_batches(tokens, docs, batch_size=B, seq_len=T, pack=True))
    again = list(eval_batches(tokens, docs, batch_size=B, seq_len=T, pack=True))
    assert len(batches) == (n - 1) // T // B > 0
    for x, y in zip(batches, again):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    covered = len(batches) * B * T
    inputs = np.concatenate([b["inputs"] for b in batches]).reshape(-1)
    targets = np.concatenate([b["targets"] for b in batches]).reshape(-1)
    assert inputs.tolist() == tokens[:covered].tolist()
    assert targets.tolist() == tokens[1:covered + 1].tolist()
    for i, (b, r) in enumerate((b, r) for b in batches for r in range(B)):
        seg, pos, mask = reference_pack(docs.tolist(), i * T, T)
        assert (b["segment_ids"][r].tolist(), b["positions"][r].tolist(),
                b["loss_mask"][r].tolist()) == (seg, pos, mask)
    assert len(list(eval_batches(tokens, docs, batch_size=B, seq_len=T, max_batches=2))) == 2
    with pytest.raises(DataError, match=f"split has {n} tokens.*needs {4 * n + 1}.*lower seq_len"):
        eval_batches(tokens, docs, batch_size=4, seq_len=n)  # raised at the call
    with pytest.raises(DataError, match="split has 5 tokens.*seq_len=8.*needs 9"):
        get_batch(tokens[:5], None, seed=0, step=0, batch_size=1, seq_len=8)
    with pytest.raises(DataError, match="pack=True needs"):
        get_batch(tokens, None, seed=0, step=0, batch_size=1, seq_len=8, pack=True)


def test_warm_stdlib_load_reads_only_the_cache(stdlib_cache, monkeypatch):
    """A second load maps the cached tokens: no document is read and nothing is tokenised
    (its speed is bench/ material, not a test's)."""
    cold = load_dataset(DataConfig(cache_dir=stdlib_cache))  # cold unless an earlier test ran

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm load read or tokenised the corpus")

    monkeypatch.setattr(dataset_module, "read_pieces", forbidden)
    monkeypatch.setattr(dataset_module, "write_tokens", forbidden)
    warm = load_dataset(DataConfig(cache_dir=stdlib_cache))
    for split in ("train", "val", "train_docs", "val_docs"):
        np.testing.assert_array_equal(getattr(warm, split), getattr(cold, split))
