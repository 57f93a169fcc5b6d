""".bin token files (jaxformer.data.token_files) against the ids written to them."""

import numpy as np
import pytest

from jaxformer.data import DataConfig, DataError, load_dataset
from tests.data.helpers import _wordlevel_tokenizer, files_in


# ---- each form of data.path -----------------------------------------------------------

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


# ---- errors ---------------------------------------------------------------------------------

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
