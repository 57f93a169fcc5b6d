"""How the text sources of ``jaxformer.data.sources.SOURCES`` read their documents.

A text source names its documents (``*_keys(corpus)``: one stable name per document, in
corpus order) and reads them (``read_*(corpus, text_field, block)``: (key, chunks) per
document, in that order, where chunks are (text, source bytes read) pairs that join to
the document's text; block: about how many characters a chunk of a long document reads
at a time). ``jaxformer.data.corpus.read_pieces`` cuts the chunks into pieces.

A file that is not text (binary, an archive, NUL bytes, mostly invalid UTF-8) is
refused, never trained on; Parquet is read 1,024 rows at a time with pyarrow (the
optional extra jaxformer[data]).
"""

from __future__ import annotations

import codecs
import json
from typing import Iterable, Iterator

from jaxformer.data.errors import DataError

Chunks = Iterable[tuple[str, int]]  # (text, source bytes read) parts of one document


# ---- files: each file is a document -----------------------------------------------------

def file_keys(corpus) -> list[str]:
    """The relative path of each file."""
    return list(corpus.files)


def read_files(corpus, text_field: str, block: int) -> Iterator[tuple[str, Chunks]]:
    for rel in corpus.files:
        yield rel, file_text(corpus.path_of(rel), block)


def file_text(path: str, block: int) -> Iterator[tuple[str, int]]:
    """(text, bytes read) a block at a time; an incremental decoder keeps a character
    that straddles two blocks whole, so the text is the whole file's decoding."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with open(path, "rb") as f:
        refuse_non_text(path, f.read(SNIFF_BYTES))  # the same head whatever the block size
        f.seek(0)
        data = f.read(block)
        while data:
            yield decoder.decode(data), len(data)
            data = f.read(block)
    yield decoder.decode(b"", final=True), 0


# ---- JSONL: each record (non-blank line) is a document ----------------------------------

def jsonl_keys(corpus) -> list[str]:
    """'file.jsonl:LINE' of each record (blank lines are not records)."""
    rel = corpus.files[0]
    with open(corpus.path_of(rel), "rb") as f:
        return [f"{rel}:{i}" for i, line in enumerate(f, 1) if line.strip()]


def read_jsonl(corpus, text_field: str, block: int) -> Iterator[tuple[str, Chunks]]:
    rel = corpus.files[0]
    path = corpus.path_of(rel)
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                text = jsonl_text(line.decode("utf-8", "replace"), text_field, f"{path}:{i}")
                yield f"{rel}:{i}", [(text, len(line))]


def jsonl_text(line: str, field: str, where: str) -> str:
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


# ---- Parquet: each row is a document ----------------------------------------------------

def parquet_keys(corpus) -> list[str]:
    """'file.parquet:ROW', rows counted from 1 across row groups."""
    return [f"{rel}:{i}" for rel in corpus.files
            for i in range(1, parquet_file(corpus.path_of(rel)).metadata.num_rows + 1)]


def read_parquet(corpus, text_field: str, block: int) -> Iterator[tuple[str, Chunks]]:
    for rel in corpus.files:
        for key, text in parquet_documents(corpus.path_of(rel), rel, text_field):
            yield key, [(text, len(text))]


def parquet_text_bytes(corpus, text_field: str) -> int:
    """The text column's uncompressed size."""
    total = 0
    for rel in corpus.files:
        meta = parquet_file(corpus.path_of(rel)).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            total += sum(group.column(c).total_uncompressed_size
                         for c in range(group.num_columns)
                         if group.column(c).path_in_schema == text_field)
    return total


def parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'jaxformer[data]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a broken file
        raise DataError(f"{path}: not a readable Parquet file ({e}); export it again, or "
                        "move it out of data.path") from None


def parquet_documents(path: str, rel: str, field: str) -> Iterator[tuple[str, str]]:
    """(key, text) of every row, reading the `field` column a batch of rows at a time."""
    f = parquet_file(path)
    columns = f.schema_arrow.names
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); set "
                        "data.text_field to the column that holds the text")
    row = 0
    for group in range(f.num_row_groups):
        i = 0
        try:
            for batch in f.iter_batches(PARQUET_ROWS, row_groups=[group], columns=[field]):
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


PARQUET_ROWS = 1024  # rows decoded at a time


# ---- what is not text -------------------------------------------------------------------

SNIFF_BYTES = 1 << 16
MAGIC = {b"PAR1": "a Parquet file (name it .parquet)", b"\x1f\x8b": "a gzip archive",
         b"PK\x03\x04": "a zip archive", b"BZh": "a bzip2 archive",
         b"\xfd7zXZ\x00": "an xz archive", b"\x28\xb5\x2f\xfd": "a zstd archive",
         b"\x7fELF": "an executable"}


def refuse_non_text(path: str, head: bytes) -> None:
    """Raises DataError for bytes that are not text: a known binary format, NUL bytes, or
    mostly (over half) invalid UTF-8. A legacy 8-bit encoding stays readable: the
    standard library's KOI8-R test module decodes to 42% replacement characters."""
    what = next((kind for magic, kind in MAGIC.items() if head.startswith(magic)), None)
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
