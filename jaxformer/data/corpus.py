"""Finding the corpus that DataConfig.path names, and reading its documents as text.

A corpus is a list of source files under a root folder. Its documents are the files
themselves ("files"), the records of a JSONL file ("jsonl"), the rows of Parquet files
("parquet", read a row group at a time with pyarrow: the optional extra
jaxformer[data]), or, for token files ("bin", "bin_pair"), nothing to read: those are
already token ids. A file that is not text (binary, an archive, NUL bytes, mostly
invalid UTF-8) is refused, never trained on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
from typing import Iterator

from jaxformer.data.config import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")
SKIP_DIRS = ("__pycache__", "site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """kind: files | jsonl | bin | bin_pair; files: '/'-separated paths relative to root."""

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

    def describe(self) -> str:
        """E.g. 'python stdlib /usr/lib/python3.11 (1790 files, 28.1 MB)'."""
        single = self.label in ("text file", "jsonl", "parquet", ".bin token file")
        where = self.path_of(self.files[0]) if single else self.root
        count = "" if single or self.kind == "bin_pair" else f"{len(self.files)} files, "
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
        return Corpus("files", root, (name,), "text file")  # read_documents checks it is text
    if os.path.isdir(path):
        has = [os.path.isfile(os.path.join(path, n)) for n in ("train.bin", "val.bin")]
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


def read_documents(corpus: Corpus, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yields (key, text) for every document, in the order of ``document_keys``."""
    if corpus.kind == "files":
        for rel in corpus.files:
            with open(corpus.path_of(rel), "rb") as f:
                data = f.read()
            refuse_non_text(corpus.path_of(rel), data[:_SNIFF_BYTES])
            yield rel, data.decode("utf-8", "replace")
        return
    if corpus.kind == "parquet":
        for rel in corpus.files:
            yield from _parquet_documents(corpus.path_of(rel), rel, text_field)
        return
    rel = corpus.files[0]
    path = corpus.path_of(rel)
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                yield f"{rel}:{i}", _jsonl_text(line, text_field, f"{path}:{i}")


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
    """(key, text) of every row, reading one row group's `field` column at a time."""
    f = _parquet_file(path)
    columns = f.schema_arrow.names
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); set "
                        "data.text_field to the column that holds the text")
    row = 0
    for group in range(f.num_row_groups):
        try:
            texts = f.read_row_group(group, columns=[field]).column(0).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: row group {group} cannot be read ({e}); export the file "
                            "again, or move it out of data.path") from None
        for i, text in enumerate(texts):
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row} (row group {group}, row {i} in it): column "
                                f"{field!r} holds {type(text).__name__} {text!r:.40}, not a "
                                "string; fix that row, or set data.text_field to a text column")
            yield f"{rel}:{row}", text


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
