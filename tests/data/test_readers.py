"""The text readers (jaxformer.data.readers): Parquet against JSONL; non-text refused."""

import json

import numpy as np
import pytest

from jaxformer.data import DataConfig, DataError, load_dataset
from tests.data.helpers import (
    offsets,
    random_text,
    reference_val,
    small_pieces,
    utf8,
    write_parquet,
)


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
