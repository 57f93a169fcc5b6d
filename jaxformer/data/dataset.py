"""load_dataset: corpus -> tokenizer -> train/val token arrays, cached as memmaps.

Splits are deterministic functions of the source files' relative paths (never of
Python's ``hash()`` or of the machine): a corpus of two or more documents is split by
document, the round-half-up(val_fraction * n) documents whose sha256(key) is smallest
going to val (at least one, never all, when val_fraction > 0); a single document or
a single .bin file is split by tokens, the last ``val_fraction`` of them going to val.
Documents are concatenated in corpus order (sorted paths, JSONL line order); empty
documents are skipped; with a tokenizer that has ``eot_id``, it follows every document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
from typing import Iterator

import numpy as np

from jaxformer.data.config import DataConfig, DataError
from jaxformer.data.corpus import Corpus, document_keys, find_corpus, read_documents
from jaxformer.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

CACHE_VERSION = 1
_ENCODE_CHUNK = 64  # documents per encode_batch call


@dataclasses.dataclass
class Dataset:
    """train/val: 1-D read-only token ids (np.memmap, uint16 or uint32) [n_tokens].
    train_docs/val_docs: int64 [n_docs] start offset of each document (first is 0;
    empty when the split is)."""

    train: np.ndarray
    val: np.ndarray
    train_docs: np.ndarray
    val_docs: np.ndarray
    tokenizer: Tokenizer
    source: str


def load_dataset(cfg: DataConfig, *, run_dir: str | None = None,
                 vocab_size: int | None = None) -> Dataset:
    """The train/val token streams that ``cfg`` describes.

    run_dir: where the tokenizer is saved as tokenizer.json (required for "bpe"; a
      tokenizer.json already there, from the run being resumed, is reused for "bpe" and
      must match for the other settings).
    vocab_size: the model's; raises DataError if the tokenizer or any token id does
      not fit (JAX would silently clamp an out-of-range id in the embedding lookup).
    """
    corpus = find_corpus(cfg.path)
    cache_dir = os.path.expanduser(cfg.cache_dir or "~/.cache/jaxformer")
    for name, pid in remove_stale_temporaries(cache_dir):
        print(f"data: removed {os.path.join(cache_dir, name)}, left by process {pid}, which "
              "is gone", file=sys.stderr)
    tokenizer = _choose_tokenizer(cfg, corpus, run_dir, cache_dir)
    if corpus.kind in ("bin", "bin_pair"):
        ds, max_id = _token_files(cfg, corpus, tokenizer)
    else:
        ds, max_id = _tokenized_text(cfg, corpus, tokenizer, cache_dir)
    _check_ids(cfg, ds, max_id, vocab_size)
    return ds


# ---- splits ---------------------------------------------------------------------------

def n_val(n: int, val_fraction: float) -> int:
    """How many of n documents (or tokens) go to val: round half up, then at least 1
    and at most n - 1 when val_fraction > 0."""
    if val_fraction == 0 or n < 2:
        return 0
    return min(max(1, math.floor(val_fraction * n + 0.5)), n - 1)


def val_keys(keys: list[str], val_fraction: float) -> set[str]:
    """The documents held out: those whose sha256(key) is among the n_val smallest."""
    ranked = sorted(keys, key=lambda k: (hashlib.sha256(k.encode()).digest(), k))
    return set(ranked[:n_val(len(keys), val_fraction)])


def _split_plan(cfg: DataConfig, corpus: Corpus) -> set[str] | None:
    """The val document keys, or None when the corpus splits by tokens (< 2 documents)."""
    keys = document_keys(corpus)
    return val_keys(keys, cfg.val_fraction) if len(keys) >= 2 else None


# ---- tokenizer ------------------------------------------------------------------------

def _choose_tokenizer(cfg: DataConfig, corpus: Corpus, run_dir: str | None,
                      cache_dir: str) -> Tokenizer:
    saved_path = os.path.join(run_dir, "tokenizer.json") if run_dir is not None else None
    saved = load_tokenizer(saved_path) if saved_path and os.path.isfile(saved_path) else None
    if cfg.tokenizer == "bytes":
        tokenizer = ByteTokenizer()
    elif cfg.tokenizer == "bpe":
        if run_dir is None:
            raise DataError("data.tokenizer='bpe' trains a tokenizer that the run must keep, "
                            "but no run_dir was given; pass run_dir to load_dataset, or set "
                            "data.tokenizer to an existing tokenizer.json")
        if corpus.kind in ("bin", "bin_pair"):
            raise DataError(f"data.tokenizer='bpe' trains on text, but {corpus.describe()} "
                            "holds token ids; set data.tokenizer to the tokenizer.json that "
                            "made them")
        tokenizer = saved or _trained_bpe(cfg, corpus, cache_dir)
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
    if saved is not None and saved.fingerprint != tokenizer.fingerprint:
        raise DataError(f"{saved_path} holds {saved!r}, which this run was started with, but "
                        f"data.tokenizer={cfg.tokenizer!r} gives {tokenizer!r}; set "
                        f"data.tokenizer={saved_path!r} to continue the run, or use a new run dir")
    if run_dir is not None and saved is None:
        tokenizer.save(run_dir)
    return tokenizer


def _trained_bpe(cfg: DataConfig, corpus: Corpus, cache_dir: str) -> Tokenizer:
    """Byte-level BPE trained on the train split only; cached by corpus and settings."""
    import tokenizers

    key = _hash(["bpe", CACHE_VERSION, tokenizers.__version__, corpus.kind,
                 corpus.fingerprint(), cfg.text_field, cfg.val_fraction, cfg.bpe_vocab_size])
    path = os.path.join(cache_dir, f"bpe-{key}.json")
    if os.path.isfile(path):
        return load_tokenizer(path)
    tokenizer = train_bpe(_train_texts(cfg, corpus), cfg.bpe_vocab_size)
    tmp = _temporary(os.path.join(cache_dir, f"bpe-{key}"))
    try:
        tokenizer.save(tmp)
        os.replace(os.path.join(tmp, "tokenizer.json"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _train_texts(cfg: DataConfig, corpus: Corpus) -> Iterator[str]:
    """The train split as text: train documents, or the first (1 - val_fraction) of the
    characters of a single document."""
    val = _split_plan(cfg, corpus)
    for key, text in read_documents(corpus, cfg.text_field):
        if val is None:
            yield text[:len(text) - n_val(len(text), cfg.val_fraction)]
        elif key not in val:
            yield text


# ---- text corpora: tokenize once into a cache -----------------------------------------

class _SplitWriter:
    """Appends documents' ids to a token file; remembers offsets and the largest id."""

    def __init__(self, path: str, dtype):
        self.file, self.dtype = open(path, "wb"), dtype
        self.docs: list[int] = []
        self.n, self.max_id = 0, -1

    def write(self, ids: np.ndarray, new_doc: bool = True) -> None:
        if len(ids) == 0:
            return
        if new_doc:
            self.docs.append(self.n)
        ids.astype(self.dtype).tofile(self.file)
        self.n += len(ids)
        self.max_id = max(self.max_id, int(ids.max()))


def _tokenized_text(cfg: DataConfig, corpus: Corpus, tokenizer: Tokenizer,
                    cache_dir: str) -> tuple[Dataset, int]:
    key = _hash(["tokens", CACHE_VERSION, corpus.kind, corpus.fingerprint(), cfg.text_field,
                 cfg.val_fraction, tokenizer.fingerprint])
    final = os.path.join(cache_dir, f"tokens-{key}")
    if not os.path.isdir(final):
        _tokenize_into(final, cfg, corpus, tokenizer)
    with open(os.path.join(final, "meta.json")) as f:
        meta = json.load(f)
    dtype = np.dtype(meta["dtype"])
    ds = Dataset(train=_memmap(os.path.join(final, "train.bin"), dtype),
                 val=_memmap(os.path.join(final, "val.bin"), dtype),
                 train_docs=np.load(os.path.join(final, "train_docs.npy")),
                 val_docs=np.load(os.path.join(final, "val_docs.npy")),
                 tokenizer=tokenizer, source=corpus.describe())
    return ds, meta["max_id"]


def _tokenize_into(final: str, cfg: DataConfig, corpus: Corpus, tokenizer: Tokenizer) -> None:
    """Writes train.bin, val.bin, *_docs.npy and meta.json into a temporary folder, then
    renames it to ``final`` in one step: an interrupted run leaves no half cache."""
    val = _split_plan(cfg, corpus)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eot = None if tokenizer.eot_id is None else np.array([tokenizer.eot_id], np.int32)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = _temporary(final)
    os.makedirs(tmp)
    out = {s: _SplitWriter(os.path.join(tmp, f"{s}.bin"), dtype) for s in ("train", "val")}
    try:
        docs = read_documents(corpus, cfg.text_field)
        for chunk in iter(lambda: list(itertools.islice(docs, _ENCODE_CHUNK)), []):
            for (key, text), ids in zip(chunk, tokenizer.encode_batch([t for _, t in chunk])):
                if len(ids) == 0:
                    continue
                if eot is not None:
                    ids = np.concatenate([ids, eot])
                if val is None:  # one document: split by tokens
                    cut = len(ids) - n_val(len(ids), cfg.val_fraction)
                    out["train"].write(ids[:cut])
                    out["val"].write(ids[cut:])
                else:
                    out["val" if key in val else "train"].write(ids)
        for split, w in out.items():
            w.file.close()
            np.save(os.path.join(tmp, f"{split}_docs.npy"), np.asarray(w.docs, np.int64))
        if out["train"].n == 0:
            raise DataError(f"{corpus.describe()} has no text for the train split; add text "
                            "(empty documents are skipped) or lower data.val_fraction")
        meta = dict(dtype=np.dtype(dtype).name, max_id=max(w.max_id for w in out.values()),
                    train_tokens=out["train"].n, val_tokens=out["val"].n,
                    source=corpus.describe(), tokenizer=tokenizer.fingerprint)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same cache first
            if not os.path.isdir(final):
                raise
    finally:
        for w in out.values():
            w.file.close()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- temporary folders ----------------------------------------------------------------

_TEMPORARY = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _temporary(final: str) -> str:
    """Where `final` is written before its atomic rename: named by host and process, so
    that a later run can tell a killed writer's leftovers from a live writer's folder."""
    return f"{final}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temporaries(cache_dir: str) -> list[tuple[str, int]]:
    """Removes the temporary folders in cache_dir that a process of this host left and
    that is no longer running (killed while tokenising); another host's are never
    touched. -> [(name, pid)] removed."""
    removed, host = [], socket.gethostname()
    for name in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else ():
        m = _TEMPORARY.search(name)
        if m and m["host"] == host and not _running(int(m["pid"])):
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
            removed.append((name, int(m["pid"])))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# ---- token files ----------------------------------------------------------------------

def _token_files(cfg: DataConfig, corpus: Corpus, tokenizer: Tokenizer) -> tuple[Dataset, int]:
    """.bin files are used in place (memmaps); documents start after each eot_id."""
    dtype = np.dtype(cfg.bin_dtype)
    arrays = [_memmap(corpus.path_of(rel), dtype) for rel in corpus.files]
    if corpus.kind == "bin":  # one file: the last val_fraction of the tokens is val
        cut = len(arrays[0]) - n_val(len(arrays[0]), cfg.val_fraction)
        arrays = [arrays[0][:cut], arrays[0][cut:]]
    if len(arrays[0]) == 0:
        raise DataError(f"{corpus.describe()} has no train tokens; add data")
    max_id = max(int(a.max()) for a in arrays if len(a))
    train, val = arrays
    return Dataset(train=train, val=val, train_docs=_doc_starts(train, tokenizer.eot_id),
                   val_docs=_doc_starts(val, tokenizer.eot_id), tokenizer=tokenizer,
                   source=corpus.describe()), max_id


def _doc_starts(tokens: np.ndarray, eot_id: int | None) -> np.ndarray:
    """int64 [n_docs]: 0 and every position right after an eot_id (but not past the end)."""
    if len(tokens) == 0:
        return np.zeros(0, np.int64)
    if eot_id is None:
        return np.zeros(1, np.int64)
    after = np.flatnonzero(np.asarray(tokens) == eot_id) + 1
    return np.concatenate([[0], after[after < len(tokens)]]).astype(np.int64)


# ---- helpers ----------------------------------------------------------------------------

def _check_ids(cfg: DataConfig, ds: Dataset, max_id: int, vocab_size: int | None) -> None:
    """Every id must fit the model (JAX would silently clamp an out-of-range embedding
    lookup) and the tokenizer (a .bin made by another tokenizer would decode wrongly)."""
    tokenizer = ds.tokenizer
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(f"{ds.source} holds token id {max_id} but model.vocab_size={vocab_size} "
                        "(JAX would silently clamp it in the embedding lookup); set "
                        f"model.vocab_size >= {max_id + 1}, or use the matching tokenizer")
    if max_id >= tokenizer.vocab_size:
        raise DataError(f"{ds.source} holds token id {max_id}, but the tokenizer "
                        f"({tokenizer!r}) has only {tokenizer.vocab_size} ids; set "
                        "data.tokenizer to the tokenizer.json that made the file (and check "
                        f"data.bin_dtype={cfg.bin_dtype!r})")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        hint = f" or data.bpe_vocab_size <= {vocab_size}" if cfg.tokenizer == "bpe" else ""
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size="
                        f"{vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}{hint}")


def _memmap(path: str, dtype) -> np.ndarray:
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


def _hash(parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]
