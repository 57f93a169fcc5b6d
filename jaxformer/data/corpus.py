"""Finding the corpus that DataConfig.path names, and reading its documents as text.

A corpus is a list of source files under a root folder, of one kind: an entry of
``jaxformer.data.sources.SOURCES``, which says which paths the kind claims and how they
are read. Its documents are the files themselves ("files"), the records of a JSONL file
("jsonl"), the rows of Parquet files ("parquet"), or, for token files ("bin",
"bin_pair"), nothing to read: those are already token ids; or, for a folder that
``python -m jaxformer.data.prepare`` wrote ("prepared"), token ids with their tokenizer.

Documents are read as pieces of about PIECE_CHARS characters (``read_pieces``): a file
a block at a time, so memory does not grow with its size, and a long record is cut too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sysconfig
from typing import Iterator, NamedTuple

from jaxformer.data.errors import DataError
from jaxformer.data.sources import SOURCES, TEXT_SUFFIXES, Source, in_order, walk

PIECE_CHARS = 1 << 19  # what one piece of a long document holds, about
SKIP_DIRS = ("__pycache__", "site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """kind: a key of SOURCES (files | jsonl | parquet | bin | bin_pair | prepared, or
    one added); files: '/'-separated paths relative to root."""

    kind: str
    root: str
    files: tuple[str, ...]
    label: str

    @property
    def source(self) -> Source:
        return SOURCES[self.kind]

    def path_of(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """(relative path, size, mtime_ns) of every source file: the cache key's input
        (unless the kind's entry says otherwise)."""
        if self.source.fingerprint is not None:
            return self.source.fingerprint(self)
        out = []
        for rel in self.files:
            st = os.stat(self.path_of(rel))
            out.append((rel, st.st_size, st.st_mtime_ns))
        return out

    def n_bytes(self) -> int:
        return sum(os.path.getsize(self.path_of(rel)) for rel in self.files)

    def text_bytes(self, text_field: str = "text") -> int:
        """About how much text the corpus holds, for progress bars, samples and disk
        checks: the files' sizes, or what the kind's entry says (for Parquet the text
        column's uncompressed size)."""
        if self.source.text_bytes is None:
            return self.n_bytes()
        return self.source.text_bytes(self, text_field)

    def describe(self) -> str:
        """E.g. 'python stdlib /usr/lib/python3.11 (1790 files, 28.1 MB)'."""
        single = bool(self.source.label) and self.label == self.source.label
        where = self.path_of(self.files[0]) if single else self.root
        count = "" if single or not self.source.counts_files else f"{len(self.files)} files, "
        return f"{self.label} {where} ({count}{_size(self.n_bytes())})"


def _size(n: int) -> str:
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def find_corpus(path: str | None) -> Corpus:
    """The corpus for DataConfig.path (None = the Python standard library's source): of
    the first entry of SOURCES, in find order (``sources.in_order``), that claims it."""
    if path is None:
        return stdlib_corpus()
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):  # a text file's read_pieces checks that it is text
        root, name = os.path.split(path)
        kind = next(k for k, s in in_order() if s.catch_all or
                    (s.suffix and name.endswith(s.suffix)))
        return Corpus(kind, root, (name,), SOURCES[kind].label)
    if os.path.isdir(path):
        for kind, source in in_order():
            files = source.folder(path) if source.folder is not None else ()
            if files:
                return Corpus(kind, path, files, source.folder_label)
        raise DataError(f"no {'/'.join(TEXT_SUFFIXES)} or .parquet files under {path}; add "
                        "some, or point data.path at a text, .jsonl, .parquet or .bin file")
    raise DataError(f"data.path={path!r} does not exist; point it at a text/.jsonl/.parquet/.bin "
                    "file or a folder, or leave it unset for the Python stdlib corpus")


def stdlib_corpus() -> Corpus:
    """Every .py file of the standard library, without site-packages/dist-packages
    (which can live inside it, e.g. with pyenv) and __pycache__; sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = walk(root, (".py",), skip_dirs=SKIP_DIRS) if os.path.isdir(root) else ()
    if not files:
        raise DataError(f"no .py files in the Python standard library at {root} (a build "
                        "without sources?); set data.path to a corpus of your own")
    return Corpus("files", root, files, "python stdlib")


def document_keys(corpus: Corpus) -> list[str]:
    """One stable name per document, in corpus order: the relative path of a file, or
    'file.jsonl:LINE' for a JSONL record (blank lines are not records), 'file.parquet:ROW'
    for a Parquet row (counted from 1 across row groups): what the kind's entry says."""
    if not corpus.source.holds_text:
        raise ValueError(f"a {corpus.kind} corpus holds token ids, not documents")
    return corpus.source.document_keys(corpus)


class Piece(NamedTuple):
    key: str  # the document's, as document_keys names it
    text: str
    end: bool  # the document's last piece
    size: int  # source bytes read for it (progress)


def read_pieces(corpus: Corpus, text_field: str = "text",
                piece_chars: int | None = None) -> Iterator[Piece]:
    """Every document, in the order of ``document_keys``, cut into pieces of about
    piece_chars (default PIECE_CHARS; see ``cut_point``); every document ends with a
    piece with end=True, and joined, a document's pieces are its text exactly."""
    piece_chars = piece_chars or PIECE_CHARS
    if not corpus.source.holds_text:
        raise ValueError(f"a {corpus.kind} corpus holds token ids, not documents")
    for key, chunks in corpus.source.read(corpus, text_field, piece_chars):
        yield from _cut(key, chunks, piece_chars)


def _cut(key: str, chunks, piece_chars: int) -> Iterator[Piece]:
    """One document, arriving as (text, bytes) chunks, re-cut into pieces."""
    buf, size = "", 0
    for text, n in chunks:
        buf, size = buf + text, size + n
        while len(buf) >= piece_chars:
            at = cut_point(buf, piece_chars // 2)
            yield Piece(key, buf[:at], False, size)
            buf, size = buf[at:], 0
    yield Piece(key, buf, True, size)


_CLEAN_CUT = re.compile(r"[!-~]\n(?=[!-~])")


def cut_point(text: str, lo: int) -> int:
    """Where a piece of ``text`` ends, at or after lo: after the first newline that has a
    visible ASCII character on each side, else after the last newline, else at lo. A
    byte-level BPE (GPT-2's pre-tokenizer) splits text at such a newline whether or not
    it is cut there, so its tokens are the same as the uncut document's."""
    m = _CLEAN_CUT.search(text, max(lo - 1, 0))
    if m:
        return m.end()
    newline = text.rfind("\n", lo)
    return newline + 1 if newline >= 0 else lo
