"""load_dataset (jaxformer.data.dataset) against plain-Python splits; its BPE sample; errors."""

import json

import numpy as np
import pytest

from jaxformer.data import DataConfig, DataError, load_dataset, load_tokenizer
from jaxformer.data.corpus import find_corpus
from tests.data.helpers import offsets, random_lines, random_text, reference_val, utf8


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


# ---- text of any size: pieces, memory, speed's plumbing ------------------------------------

def test_bpe_trains_on_a_bounded_sample_spread_over_the_train_split(rng, tmp_path):
    """data.bpe_train_bytes bounds the text BPE is trained on; the sample is drawn from
    the whole train split (its start, middle and end), never from val, and the run log
    says how much it used. A single document's sample stops before its val tail."""
    from jaxformer.data.tokenizer_kinds import _BpeSample
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

    text = random_lines(rng, 20_000)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    one = DataConfig(path=str(tmp_path / "one.txt"), val_fraction=0.1, bpe_train_bytes=10**9)
    taken = "".join(_BpeSample(one, find_corpus(one.path)).texts(Bar()))
    train = int(len(text.encode()) * 0.9)  # the first 90% of its bytes, up to a character
    assert text.startswith(taken) and train - 4 <= len(taken.encode()) <= train


# ---- errors ---------------------------------------------------------------------------------

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
