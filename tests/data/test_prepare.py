"""python -m jaxformer.data.prepare's folder against load_dataset on the same corpus."""

import json
import os
import re

import numpy as np
import pytest

from jaxformer.data import ByteTokenizer, DataConfig, DataError, load_dataset, load_tokenizer
from tests.data.helpers import killed_writer, random_text, utf8


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


def test_the_cli_runs_without_a_warning_and_refuses_an_empty_out(tmp_path):
    """`python -m jaxformer.data.prepare` finds its module not yet imported by the package
    (runpy's RuntimeWarning otherwise; here an error) and refuses out= with no folder, in one
    line; the package's `prepare` is still the function."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    for out in ("out=", "out= "):
        r = subprocess.run([sys.executable, "-m", "jaxformer.data.prepare", "data.path=x", out],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 2 and r.stdout == "" and r.stderr == (
            "error: out= is empty; name the folder to write, out=DIR; usage: python -m "
            "jaxformer.data.prepare [config.yaml] [data.key=value ...] out=DIR\n"), r.stderr
    assert os.listdir(tmp_path) == []
    from jaxformer.data import prepare
    with pytest.raises(DataError, match="^out is empty; name the folder to write$"):
        prepare(DataConfig(path=str(tmp_path / "none")), " ")


def test_a_prepared_folder_refuses_a_named_tokenizer_it_was_not_made_with(rng, tmp_path):
    """data.tokenizer=bpe on a folder prepared with bytes, or with a BPE of another
    data.bpe_vocab_size, is refused naming both (bytes is the default: a config saying
    bytes is one that leaves it unset); the same bpe settings, or none, use the folder's."""
    from jaxformer.data.prepare import prepare
    (tmp_path / "d.txt").write_text(random_text(rng, int(rng.integers(2000, 4000))))
    cache, quiet = str(tmp_path / "c"), dict(progress=False, log=lambda m: None)
    size = int(rng.integers(270, 320))  # merges enough for more than 257 ids
    made = {"bytes": DataConfig(path=str(tmp_path / "d.txt"), cache_dir=cache),
            "bpe": DataConfig(path=str(tmp_path / "d.txt"), cache_dir=cache, tokenizer="bpe",
                              bpe_vocab_size=size)}
    for kind, cfg in made.items():
        prepare(cfg, str(tmp_path / kind), **quiet)
    other = size + int(rng.integers(1, 200))
    for kind, asked, shown in (("bytes", size, r"ByteTokenizer\(vocab_size=256\)"),
                               ("bpe", other, r"HFTokenizer\(vocab_size=\d+, eot_id=0\)")):
        with pytest.raises(DataError) as err:
            load_dataset(DataConfig(path=str(tmp_path / kind), tokenizer="bpe",
                                    bpe_vocab_size=asked), run_dir=str(tmp_path / "r"), **quiet)
        assert re.fullmatch(rf"{tmp_path / kind} was prepared with {shown}, not with "
                            rf"data.tokenizer='bpe' data.bpe_vocab_size={asked}; leave "
                            "data.tokenizer unset to use the folder's, or prepare the data "
                            "again with this tokenizer", str(err.value)), str(err.value)
    for cfg in (made["bpe"], DataConfig(), made["bytes"]):
        kind = "bpe" if cfg.tokenizer == "bpe" else "bytes"
        ds = load_dataset(cfg.replace(path=str(tmp_path / kind)), **quiet)
        assert ds.tokenizer.fingerprint == load_tokenizer(tmp_path / kind).fingerprint
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())  # as written before
    del meta["trained"]                                              # it held the size
    (tmp_path / "bpe" / "meta.json").write_text(json.dumps(meta))
    load_dataset(made["bpe"].replace(path=str(tmp_path / "bpe")), **quiet)
    with pytest.raises(DataError, match="was prepared with HFTokenizer"):
        load_dataset(made["bpe"].replace(path=str(tmp_path / "bpe"), bpe_vocab_size=257),
                     **quiet)
