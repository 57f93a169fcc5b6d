"""Finding the corpus that DataConfig.path names, and reading its documents as text.

A corpus is a list of source files under a root folder. Its documents are the files
themselves ("files"), the records of a JSONL file ("jsonl"), the rows of Parquet files
("parquet", read 1,024 rows at a time with pyarrow: the optional extra
jaxformer[data]), or, for token files ("bin", "bin_pair"), nothing to read: those are
already token ids; or, for a folder that ``python -m jaxformer.data.prepare`` wrote
("prepared"), token ids with their tokenizer. A file that is not text (binary, an archive,
NUL bytes, mostly invalid UTF-8) is refused, never trained on.

Documents are read as pieces of about PIECE_CHARS characters (``read_pieces``): a file
a block at a time, so memory does not grow with its size, and a long record is cut too.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import re
import sysconfig
from typing import Iterator, NamedTuple

from jaxformer.data.config import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")
PIECE_CHARS = 1 << 19  # what one piece of a long document holds, about
SKIP_DIRS = ("__pycache__", "site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """kind: files | jsonl | parquet | bin | bin_pair | prepared; files: '/'-separated
    paths relative to root."""

    kind: str
    root: str
    files: tuple[str, ...]
    label: str

    def path_of(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """(relative path, size, mtime_ns) of every source file: the cache key's input."""
        out = []
        for rel in self.files:
            st = os.stat(self.path_of(rel))
            out.append((rel, st.st_size, st.st_mtime_ns))
        return out

    def n_bytes(self) -> int:
        return sum(os.path.getsize(self.path_of(rel)) for rel in self.files)

    def text_bytes(self, text_field: str = "text") -> int:
        """About how much text the corpus holds, for progress bars, samples and disk
        checks: the files' sizes, or for Parquet the text column's uncompressed size."""
        if self.kind != "parquet":
            return self.n_bytes()
        total = 0
        for rel in self.files:
            meta = _parquet_file(self.path_of(rel)).metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                total += sum(group.column(c).total_uncompressed_size
                             for c in range(group.num_columns)
                             if group.column(c).path_in_schema == text_field)
        return total

    def describe(self) -> str:
        """E.g. 'python stdlib /usr/lib/python3.11 (1790 files, 28.1 MB)'."""
        single = self.label in ("text file", "jsonl", "parquet", ".bin token file")
        where = self.path_of(self.files[0]) if single else self.root
        count = "" if single or self.kind in ("bin_pair", "prepared") else \
            f"{len(self.files)} files, "
        return f"{self.label} {where} ({count}{_size(self.n_bytes())})"


def _size(n: int) -> str:
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def find_corpus(path: str | None) -> Corpus:
    """The corpus for DataConfig.path (None = the Python standard library's source)."""
    if path is None:
        return stdlib_corpus()
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        root, name = os.path.split(path)
        if path.endswith(".bin"):
            return Corpus("bin", root, (name,), ".bin token file")
        if path.endswith(".jsonl"):
            return Corpus("jsonl", root, (name,), "jsonl")
        if path.endswith(".parquet"):
            return Corpus("parquet", root, (name,), "parquet")
        return Corpus("files", root, (name,), "text file")  # read_pieces checks it is text
    if os.path.isdir(path):
        has = [os.path.isfile(os.path.join(path, n)) for n in ("train.bin", "val.bin")]
        if all(has) and os.path.isfile(os.path.join(path, "meta.json")):
            return Corpus("prepared", path, ("train.bin", "val.bin"), "prepared tokens")
        if all(has):
            return Corpus("bin_pair", path, ("train.bin", "val.bin"), ".bin token files")
        if any(has):
            raise DataError(f"{path} holds {'train.bin' if has[0] else 'val.bin'} but not "
                            f"{'val.bin' if has[0] else 'train.bin'}; a token folder needs both "
                            "(or point data.path at the one .bin file to split it)")
        parquet = _walk(path, (".parquet",), skip_dirs=("__pycache__",))
        if parquet:  # a dataset folder: its README.md and the like are not documents
            return Corpus("parquet", path, parquet, "parquet folder")
        files = _walk(path, TEXT_SUFFIXES, skip_dirs=("__pycache__",))
        if not files:
            raise DataError(f"no {'/'.join(TEXT_SUFFIXES)} or .parquet files under {path}; add "
                            "some, or point data.path at a text, .jsonl, .parquet or .bin file")
        return Corpus("files", path, files, "folder")
    raise DataError(f"data.path={path!r} does not exist; point it at a text/.jsonl/.parquet/.bin "
                    "file or a folder, or leave it unset for the Python stdlib corpus")


def stdlib_corpus() -> Corpus:
    """Every .py file of the standard library, without site-packages/dist-packages
    (which can live inside it, e.g. with pyenv) and __pycache__; sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = _walk(root, (".py",), skip_dirs=SKIP_DIRS) if os.path.isdir(root) else ()
    if not files:
        raise DataError(f"no .py files in the Python standard library at {root} (a build "
                        "without sources?); set data.path to a corpus of your own")
    return Corpus("files", root, files, "python stdlib")


def _walk(root: str, suffixes: tuple[str, ...], skip_dirs: tuple[str, ...]) -> tuple[str, ...]:
    """Sorted '/'-separated relative paths of files with these suffixes; skips dot-dirs."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        for name in names:
            if name.endswith(suffixes) and not name.startswith("."):
                found.append(name if rel == "." else f"{rel}/{name}")
    return tuple(sorted(found))


def document_keys(corpus: Corpus) -> list[str]:
    """One stable name per document, in corpus order: the relative path of a file, or
    'file.jsonl:LINE' for a JSONL record (blank lines are not records)."""
    if corpus.kind == "files":
        return list(corpus.files)
    if corpus.kind == "jsonl":
        rel = corpus.files[0]
        with open(corpus.path_of(rel), "rb") as f:
            return [f"{rel}:{i}" for i, line in enumerate(f, 1) if line.strip()]
    if corpus.kind == "parquet":  # 'file.parquet:ROW', rows counted from 1 across row groups
        return [f"{rel}:{i}" for rel in corpus.files
                for i in range(1, _parquet_file(corpus.path_of(rel)).metadata.num_rows + 1)]
    raise ValueError(f"a {corpus.kind} corpus holds token ids, not documents")


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
    if corpus.kind == "files":
        for rel in corpus.files:
            yield from _cut(rel, _file_text(corpus.path_of(rel), piece_chars), piece_chars)
    elif corpus.kind == "jsonl":
        rel = corpus.files[0]
        path = corpus.path_of(rel)
        with open(path, "rb") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    text = _jsonl_text(line.decode("utf-8", "replace"), text_field, f"{path}:{i}")
                    yield from _cut(f"{rel}:{i}", [(text, len(line))], piece_chars)
    elif corpus.kind == "parquet":
        for rel in corpus.files:
            for key, text in _parquet_documents(corpus.path_of(rel), rel, text_field):
                yield from _cut(key, [(text, len(text))], piece_chars)
    else:
        raise ValueError(f"a {corpus.kind} corpus holds token ids, not documents")


def _file_text(path: str, block: int) -> Iterator[tuple[str, int]]:
    """(text, bytes read) a block at a time; an incremental decoder keeps a character
    that straddles two blocks whole, so the text is the whole file's decoding."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with open(path, "rb") as f:
        refuse_non_text(path, f.read(_SNIFF_BYTES))  # the same head whatever the block size
        f.seek(0)
        data = f.read(block)
        while data:
            yield decoder.decode(data), len(data)
            data = f.read(block)
    yield decoder.decode(b"", final=True), 0


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


def _jsonl_text(line: str, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or "
                        "delete this line (each line must be one JSON object)") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; each line "
                        f"must be an object with a {field!r} field")
    if field not in record:
        raise DataError(f"{where}: no field {field!r} (fields: {', '.join(map(str, record))}); "
                        "set data.text_field to the field that holds the text")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
    return text


# ---- Parquet --------------------------------------------------------------------------

def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'jaxformer[data]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a broken file
        raise DataError(f"{path}: not a readable Parquet file ({e}); export it again, or "
                        "move it out of data.path") from None


def _parquet_documents(path: str, rel: str, field: str) -> Iterator[tuple[str, str]]:
    """(key, text) of every row, reading the `field` column a batch of rows at a time."""
    f = _parquet_file(path)
    columns = f.schema_arrow.names
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); set "
                        "data.text_field to the column that holds the text")
    row = 0
    for group in range(f.num_row_groups):
        i = 0
        try:
            for batch in f.iter_batches(_PARQUET_ROWS, row_groups=[group], columns=[field]):
                for text in batch.column(0).to_pylist():
                    row, i = row + 1, i + 1
                    if not isinstance(text, str):
                        raise DataError(
                            f"{path}: row {row} (row group {group}, row {i - 1} in it): column "
                            f"{field!r} holds {type(text).__name__} {text!r:.40}, not a string; "
                            "fix that row, or set data.text_field to a text column")
                    yield f"{rel}:{row}", text
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{path}: row group {group} cannot be read ({e}); export the file "
                            "again, or move it out of data.path") from None


_PARQUET_ROWS = 1024  # rows decoded at a time


# ---- what is not text -------------------------------------------------------------------

_SNIFF_BYTES = 1 << 16
_MAGIC = {b"PAR1": "a Parquet file (name it .parquet)", b"\x1f\x8b": "a gzip archive",
          b"PK\x03\x04": "a zip archive", b"BZh": "a bzip2 archive",
          b"\xfd7zXZ\x00": "an xz archive", b"\x28\xb5\x2f\xfd": "a zstd archive",
          b"\x7fELF": "an executable"}


def refuse_non_text(path: str, head: bytes) -> None:
    """Raises DataError for bytes that are not text: a known binary format, NUL bytes, or
    mostly (over half) invalid UTF-8. A legacy 8-bit encoding stays readable: the
    standard library's KOI8-R test module decodes to 42% replacement characters."""
    what = next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), None)
    if what is None and b"\0" in head:
        what = "binary (it holds NUL bytes)"
    if what is None and head:
        text = head.decode("utf-8", "replace")
        bad = text.count("\ufffd") / len(text)
        if bad > 0.5:
            what = f"not UTF-8 ({bad:.0%} of it is invalid)"
    if what is not None:
        raise DataError(f"{path} is not text: {what}; jaxformer reads text, .jsonl, .parquet "
                        "and .bin token files (decompress or convert it first)")
