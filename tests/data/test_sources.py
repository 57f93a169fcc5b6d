"""Every entry of jaxformer.data.sources.SOURCES against a sample corpus of its kind."""

import json
import pathlib

import numpy as np
import pytest

from jaxformer.data import DataConfig, DataError, load_dataset, load_tokenizer
from jaxformer.data import corpus as corpus_module
from jaxformer.data.corpus import find_corpus, read_pieces
from jaxformer.data.sources import SOURCES, Source
from tests.data.helpers import (
    _wordlevel_tokenizer,
    offsets,
    random_text,
    reference_val,
    small_pieces,
    utf8,
    write_parquet,
)


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
    assert kind in samples, (f"SOURCES[{kind!r}] has no sample in tests/data/test_sources.py: "
                             "add a writer of one to TEXT_SAMPLES or TOKEN_SAMPLES")
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
    longest = max(map(len, docs.values()))  # a piece no longer, so that one is cut
    for piece_chars in (None, int(rng.integers(2, 8)), min(int(rng.integers(8, 64)), longest)):
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

    # a folder whose meta.json predates its record of a trained tokenizer keeps its own for
    # a bpe of at least its vocabulary (tests/data/test_prepare.py: a larger one is refused)
    bpe = cfg.replace(tokenizer="bpe", bpe_vocab_size=8192)
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
    with open(corpus.path_of(corpus.files[0]), "rb") as f:  # the example source of docs/extending.md
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
