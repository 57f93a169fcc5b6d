"""Token folders: text tokenised once into train.bin, val.bin, train_docs.npy,
val_docs.npy and meta.json, then memory-mapped by every run (and every host) that uses it
(``jaxformer.data.token_files.open_tokens``).

``write_tokens`` streams a corpus through a tokenizer in pieces, a batch of pieces per
``encode_batch`` call, so memory stays bounded whatever the size of a file, and writes
into a temporary folder that is renamed into place in one step: a killed run leaves no
half folder, only a temporary one that ``remove_stale_temporaries`` clears later.

Splits are deterministic functions of the documents' keys (``jaxformer.data.splits``;
never of Python's ``hash()`` or of the machine): a corpus of two or more documents is
split by document, the round-half-up(val_fraction * n) documents whose sha256(key) is
smallest going to val (at least one, never all, when val_fraction > 0); a single
document is split by tokens, the last ``val_fraction`` of them going to val. Documents
are written in corpus order; empty documents are skipped; with a tokenizer that has
``eot_id``, it follows every document.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from typing import Callable, Iterator

import numpy as np

from jaxformer.data.errors import DataError
from jaxformer.data.corpus import PIECE_CHARS, Corpus, Piece, document_keys, read_pieces
from jaxformer.data.splits import n_val, val_keys
from jaxformer.data.token_files import trained_setting
from jaxformer.data.tokenizer import Tokenizer

# Characters per encode_batch call: enough pieces for every core (the tokenizer
# parallelises over a batch's pieces), few enough that its working memory (about 60
# bytes per character for a Hugging Face BPE) stays small.
BATCH_CHARS = min(32 << 20, max(4 << 20, 2 * (os.cpu_count() or 1) * PIECE_CHARS))
BAR_DELAY = 1.0  # seconds before a progress bar shows
_BATCH_PIECES = 4096  # many short records: fewer Python calls, same memory bound
CACHE_VERSION = 2  # in every cache key: raise it when what a key names is made differently


def cache_key(parts) -> str:
    """The cache's name for what `parts` (JSON values) describe."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


# ---- splits ---------------------------------------------------------------------------

def split_plan(cfg, corpus: Corpus) -> set[str] | None:
    """The val document keys, or None when the corpus splits by tokens (< 2 documents)."""
    keys = document_keys(corpus)
    return val_keys(keys, cfg.val_fraction) if len(keys) >= 2 else None


# ---- writing ----------------------------------------------------------------------------

class _SplitWriter:
    """Appends a split's tokens to its .bin file; remembers where each document starts
    and the largest id."""

    def __init__(self, path: str, dtype, eot_id: int | None):
        self.path, self.file, self.dtype = path, open(path, "wb"), np.dtype(dtype)
        self.eot = None if eot_id is None else np.array([eot_id], self.dtype)
        self.docs: list[int] = []
        self.n, self.max_id, self.in_doc = 0, -1, False

    def write(self, ids: np.ndarray, end: bool) -> None:
        """One piece of a document; `end`: the document's last (then eot follows it)."""
        if len(ids):
            if not self.in_doc:
                self.docs.append(self.n)
                self.in_doc = True
            self._append(ids.astype(self.dtype, copy=False))
        if end and self.in_doc:
            if self.eot is not None:
                self._append(self.eot)
            self.in_doc = False

    def _append(self, ids: np.ndarray) -> None:
        ids.tofile(self.file)
        self.n += len(ids)
        self.max_id = max(self.max_id, int(ids.max()))

    def move_tail(self, k: int, to: "_SplitWriter") -> None:
        """Moves the last k tokens into `to` as one document (a single document's split)."""
        self.file.flush()
        if k == 0:
            return
        tail = np.fromfile(self.path, self.dtype, offset=(self.n - k) * self.dtype.itemsize)
        self.file.truncate((self.n - k) * self.dtype.itemsize)
        self.file.seek(0, os.SEEK_END)
        self.n -= k
        to.docs.append(to.n)
        to._append(tail)


def write_tokens(final: str, cfg, corpus: Corpus, tokenizer: Tokenizer, *,
                 progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Tokenises `corpus` into the token folder `final` (which must not exist yet);
    returns its meta.json. Raises DataError before writing much when the disk is too
    small, and when the train split would be empty."""
    log = log or to_stderr
    val = split_plan(cfg, corpus)
    dtype = smallest_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    tmp = temporary_path(final)
    os.makedirs(tmp)
    out = {s: _SplitWriter(os.path.join(tmp, f"{s}.bin"), dtype, tokenizer.eot_id)
           for s in ("train", "val")}
    started, visible = time.perf_counter(), False  # visible: a piece not only whitespace
    try:
        text_bytes = corpus.text_bytes(cfg.text_field)
        with progress_bar(progress, text_bytes, "tokenising") as bar:
            for i, batch in enumerate(_batches(read_pieces(corpus, cfg.text_field))):
                visible = visible or any(p.text and not p.text.isspace() for p in batch)
                for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch])):
                    out["val" if val is not None and piece.key in val else "train"].write(
                        ids, piece.end)
                done = sum(p.size for p in batch)
                bar.update(done)
                if i == 0:
                    _check_disk(tmp, sum(w.n for w in out.values()) * out["train"].dtype.itemsize,
                                done, text_bytes, corpus)
        if val is None:  # one document: the last val_fraction of its tokens
            out["train"].move_tail(n_val(out["train"].n, cfg.val_fraction), out["val"])
        meta = _finish(tmp, out, corpus, tokenizer, cfg, visible)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same folder first
            if not os.path.isdir(final):
                raise
    finally:
        for w in out.values():
            w.file.close()
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - started
    log(f"data: tokenised {corpus.describe()} into {meta['train_tokens']:,} train and "
        f"{meta['val_tokens']:,} val tokens in {seconds:.1f} s "
        f"({text_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s) at {final}")
    return meta


def smallest_dtype(vocab_size: int) -> np.dtype:
    """uint8 for bytes (half the disk and page cache of uint16), uint16, or uint32."""
    return np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32)
                         if vocab_size <= np.iinfo(t).max + 1))


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS or len(batch) >= _BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _finish(tmp: str, out: dict[str, _SplitWriter], corpus: Corpus, tokenizer: Tokenizer,
            cfg, visible: bool) -> dict:
    for split, w in out.items():
        w.file.close()
        np.save(os.path.join(tmp, f"{split}_docs.npy"), np.asarray(w.docs, np.int64))
    if out["val"].n + out["train"].n == 0:
        raise DataError(f"{corpus.describe()} has no text; add text (empty documents are "
                        "skipped)")
    if not visible:
        raise DataError(f"{corpus.describe()} holds only whitespace; add text")
    if out["train"].n == 0:
        raise DataError(f"{corpus.describe()} has no text for the train split; add text "
                        "(empty documents are skipped) or lower data.val_fraction")
    meta = dict(dtype=out["train"].dtype.name, max_id=max(w.max_id for w in out.values()),
                train_tokens=out["train"].n, val_tokens=out["val"].n,
                source=corpus.describe(), tokenizer=tokenizer.fingerprint,
                trained=trained_setting(cfg),
                text_field=cfg.text_field, val_fraction=cfg.val_fraction)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _check_disk(folder: str, written: int, done: int, total: int, corpus: Corpus) -> None:
    """After the first batch: the tokens still to come, at the rate so far, must fit."""
    need = int(written / max(done, 1) * max(total - done, 0) * 1.05)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DataError(f"tokenising {corpus.describe()} needs about {need / 1e9:.2f} GB more "
                        f"in {os.path.dirname(folder)}, but {free / 1e9:.2f} GB is free; free "
                        "some space, or set data.cache_dir (or prepare's out=) to a disk "
                        "with room")


# ---- progress and messages ----------------------------------------------------------------

def progress_bar(enabled: bool, total: int, what: str):
    """A tqdm bar in MB on stderr, shown once a job has taken a second (a short one stays
    quiet); a do-nothing bar when not enabled (e.g. on every process but the first)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"data: {what}", unit="B", unit_scale=True,
                unit_divisor=1000, file=sys.stderr, disable=not enabled, delay=BAR_DELAY,
                mininterval=0.5 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)


def to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- temporary folders ----------------------------------------------------------------

_TEMPORARY = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temporary_path(final: str) -> str:
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
