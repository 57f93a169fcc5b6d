"""Token ids on disk, mapped read-only: nanoGPT-style .bin files, and token folders
(train.bin, val.bin, train_docs.npy, val_docs.npy, meta.json: what
``jaxformer.data.tokens.write_tokens`` writes). The token sources' entries in
``jaxformer.data.sources.SOURCES`` map their train and val splits with the functions
here: each takes (DataConfig, Corpus, Tokenizer) and returns ({train, val, train_docs,
val_docs}, the largest id)."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxformer.data.errors import DataError
from jaxformer.data.splits import n_val
from jaxformer.data.tokenizer import Tokenizer, load_tokenizer


def memmap(path: str, dtype) -> np.ndarray:
    """A read-only memmap of a token file (an empty read-only array for an empty file)."""
    size = os.path.getsize(path)
    if size % np.dtype(dtype).itemsize:
        raise DataError(f"{path} is {size} bytes, not a multiple of {np.dtype(dtype).itemsize}; "
                        f"is data.bin_dtype={np.dtype(dtype).name!r} right?")
    if size == 0:
        empty = np.zeros(0, dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r")


def open_tokens(folder: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta.json, {train, val: read-only memmaps; train_docs, val_docs: int64})."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    dtype = np.dtype(meta["dtype"])
    arrays = {s: memmap(os.path.join(folder, f"{s}.bin"), dtype) for s in ("train", "val")}
    for s in ("train", "val"):
        arrays[f"{s}_docs"] = np.load(os.path.join(folder, f"{s}_docs.npy"))
    return meta, arrays


# ---- the token sources' maps ----------------------------------------------------------

def split_one_file(cfg, corpus, tokenizer: Tokenizer) -> tuple[dict, int]:
    """One .bin file, used in place: the last val_fraction of its tokens is val."""
    tokens = memmap(corpus.path_of(corpus.files[0]), np.dtype(cfg.bin_dtype))
    cut = len(tokens) - n_val(len(tokens), cfg.val_fraction)
    return _bin_splits(corpus, tokens[:cut], tokens[cut:], tokenizer)


def train_and_val_files(cfg, corpus, tokenizer: Tokenizer) -> tuple[dict, int]:
    """A folder's train.bin and val.bin, used in place."""
    train, val = (memmap(corpus.path_of(rel), np.dtype(cfg.bin_dtype)) for rel in corpus.files)
    return _bin_splits(corpus, train, val, tokenizer)


def _bin_splits(corpus, train: np.ndarray, val: np.ndarray,
                tokenizer: Tokenizer) -> tuple[dict, int]:
    """Documents start after each eot_id."""
    if len(train) == 0:
        raise DataError(f"{corpus.describe()} has no train tokens; add data")
    max_id = max(int(a.max()) for a in (train, val) if len(a))
    return dict(train=train, val=val, train_docs=doc_starts(train, tokenizer.eot_id),
                val_docs=doc_starts(val, tokenizer.eot_id)), max_id


def doc_starts(tokens: np.ndarray, eot_id: int | None) -> np.ndarray:
    """int64 [n_docs]: 0 and every position right after an eot_id (but not past the end)."""
    if len(tokens) == 0:
        return np.zeros(0, np.int64)
    if eot_id is None:
        return np.zeros(1, np.int64)
    after = np.flatnonzero(np.asarray(tokens) == eot_id) + 1
    return np.concatenate([[0], after[after < len(tokens)]]).astype(np.int64)


def prepared_folder(cfg, corpus, tokenizer: Tokenizer) -> tuple[dict, int]:
    """A folder that ``python -m jaxformer.data.prepare`` wrote, mapped in place."""
    meta, arrays = open_tokens(corpus.root)
    return arrays, meta["max_id"]


def prepared_tokenizer(cfg, corpus) -> Tokenizer:
    """A prepared folder's own tokenizer.json: the one its tokens were made with."""
    tokenizer = load_tokenizer(corpus.root)
    with open(os.path.join(corpus.root, "meta.json")) as f:
        meta = json.load(f)
    if tokenizer.fingerprint != meta["tokenizer"]:
        raise DataError(f"{corpus.root}/tokenizer.json is not the tokenizer its tokens were "
                        "made with (meta.json names another); prepare the folder again")
    if cfg.tokenizer_entry.is_path:
        other = load_tokenizer(cfg.tokenizer).fingerprint != tokenizer.fingerprint
        asked = f"data.tokenizer={cfg.tokenizer!r}"
    else:  # bytes, the default, cannot be told from unset; bpe is named with its size
        wanted = trained_setting(cfg)
        other = wanted is not None and not _trained_as(meta, tokenizer, wanted)
        asked = " ".join(f"data.{k}={v!r}" for k, v in (wanted or {}).items())
    if other:
        raise DataError(f"{corpus.root} was prepared with {tokenizer!r}, not with {asked}; "
                        "leave data.tokenizer unset to use the folder's, or prepare the data "
                        "again with this tokenizer")
    return tokenizer


def _trained_as(meta: dict, tokenizer: Tokenizer, wanted: dict) -> bool:
    """The folder's tokenizer was trained as `wanted` (trained_setting) says: as
    meta.json records; in a folder written before it did, a tokenizer.json of at most the
    vocabulary size asked for (a small corpus may give fewer)."""
    if "trained" in meta:
        return meta["trained"] == wanted
    size = [v for k, v in wanted.items() if k != "tokenizer"]
    return tokenizer.fingerprint.startswith("hf-") and all(tokenizer.vocab_size <= v
                                                           for v in size)


def trained_setting(cfg) -> dict | None:
    """A tokenizer that data.tokenizer trains (bpe): what names it, e.g. {"tokenizer":
    "bpe", "bpe_vocab_size": 4096}; None for one given (bytes, a tokenizer.json)."""
    kind = cfg.tokenizer_entry
    if not kind.trains:
        return None
    return {"tokenizer": cfg.tokenizer, **({kind.vocab_key: getattr(cfg, kind.vocab_key)}
                                           if kind.vocab_key else {})}
