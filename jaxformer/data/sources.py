"""The kinds of corpus, one entry each in SOURCES: which paths a kind claims, and how its
documents (text) or token ids are read.

``find_corpus`` tries the entries in table order, the catch-all ("files": any other
file, a folder of text files) last; the first that claims a path makes the corpus. A
new format is one new entry, added from anywhere (a plain dict)::

    def tsv_keys(corpus):  # one stable name per document, in order: 'docs.tsv:LINE'
        with open(corpus.path_of(corpus.files[0]), "rb") as f:
            return [f"{corpus.files[0]}:{i}" for i, _ in enumerate(f, 1)]

    def read_tsv(corpus, text_field, block):  # (key, [(text, bytes read)]) per document
        with open(corpus.path_of(corpus.files[0]), "rb") as f:
            for i, line in enumerate(f, 1):
                yield f"{corpus.files[0]}:{i}", [(line.decode("utf-8").rstrip("\\n"),
                                                  len(line))]

    SOURCES["tsv"] = Source(suffix=".tsv", label="tsv", document_keys=tsv_keys,
                            read=read_tsv)

The key is the kind's name (``Corpus.kind``), which the cache keys hash: never rename
one, or every cached token folder of that kind is made again.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from jaxformer.data import readers, token_files
from jaxformer.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")


@dataclasses.dataclass(frozen=True)
class Source:
    """One kind of corpus. Which paths it claims:

    suffix: a file whose name ends with it (None: none by its name).
    label: describe()'s word for a corpus of one such file.
    folder(path) -> the files of a folder of this kind ('/'-separated paths relative to
      it, sorted), or () when it is not one; may raise DataError (half a layout).
    folder_label: describe()'s word for such a folder.
    catch_all: claims any file no other entry claims; tried after every other entry
      (those added later too).
    counts_files: describe() says how many files a folder of this kind holds.

    A text source has document_keys and read (holds_text); a token source, map_tokens:
    document_keys(corpus) -> one stable name per document, in corpus order.
    read(corpus, text_field, block) -> (key, chunks) for each document in that order;
      chunks: (text, source bytes read) pairs that join to its text; block: about how
      many characters to read at a time where a document can be long (see readers).
    text_bytes(corpus, text_field) -> about how much text it holds (progress, the BPE
      sample, disk checks); None: the files' sizes.
    map_tokens(cfg, corpus, tokenizer) -> ({train, val, train_docs, val_docs}, the
      largest id): its splits, mapped (see token_files).
    tokenizer(cfg, corpus) -> the tokenizer its ids come with; None: data.tokenizer's.
    fingerprint(corpus) -> what the cache keys hash for its files; None:
      (relative path, size, mtime_ns) of each.
    """

    suffix: str | None = None
    label: str = ""
    folder: Callable[[str], tuple[str, ...]] | None = None
    folder_label: str = ""
    catch_all: bool = False
    counts_files: bool = True
    document_keys: Callable | None = None
    read: Callable | None = None
    text_bytes: Callable | None = None
    map_tokens: Callable | None = None
    tokenizer: Callable | None = None
    fingerprint: Callable | None = None

    def __post_init__(self):
        if (self.read is None) == (self.map_tokens is None):
            raise ValueError("a Source reads documents (read) or maps token ids "
                             "(map_tokens): give one of them")
        if (self.read is None) != (self.document_keys is None):
            raise ValueError("a text Source needs both document_keys and read")

    @property
    def holds_text(self) -> bool:
        return self.read is not None


def walk(root: str, suffixes: tuple[str, ...],
         skip_dirs: tuple[str, ...] = ("__pycache__",)) -> tuple[str, ...]:
    """Sorted '/'-separated relative paths of files with these suffixes; skips dot-dirs
    and dot-files."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        for name in names:
            if name.endswith(suffixes) and not name.startswith("."):
                found.append(name if rel == "." else f"{rel}/{name}")
    return tuple(sorted(found))


# ---- folder layouts -------------------------------------------------------------------

def prepared_files(folder: str) -> tuple[str, ...]:
    """What ``python -m jaxformer.data.prepare`` writes: train.bin, val.bin, meta.json."""
    names = ("train.bin", "val.bin", "meta.json")
    return names[:2] if all(os.path.isfile(os.path.join(folder, n)) for n in names) else ()


def bin_pair_files(folder: str) -> tuple[str, ...]:
    """train.bin and val.bin; one of them alone is refused."""
    has = [os.path.isfile(os.path.join(folder, n)) for n in ("train.bin", "val.bin")]
    if all(has):
        return ("train.bin", "val.bin")
    if any(has):
        raise DataError(f"{folder} holds {'train.bin' if has[0] else 'val.bin'} but not "
                        f"{'val.bin' if has[0] else 'train.bin'}; a token folder needs both "
                        "(or point data.path at the one .bin file to split it)")
    return ()


def parquet_files(folder: str) -> tuple[str, ...]:
    """A dataset folder: its README.md and the like are not documents."""
    return walk(folder, (".parquet",))


def text_files(folder: str) -> tuple[str, ...]:
    return walk(folder, TEXT_SUFFIXES)


# ---- the table --------------------------------------------------------------------------

SOURCES: dict[str, Source] = {
    "prepared": Source(folder=prepared_files, folder_label="prepared tokens",
                       counts_files=False, map_tokens=token_files.prepared_folder,
                       tokenizer=token_files.prepared_tokenizer),
    "bin_pair": Source(folder=bin_pair_files, folder_label=".bin token files",
                       counts_files=False, map_tokens=token_files.train_and_val_files),
    "bin": Source(suffix=".bin", label=".bin token file",
                  map_tokens=token_files.split_one_file),
    "jsonl": Source(suffix=".jsonl", label="jsonl", document_keys=readers.jsonl_keys,
                    read=readers.read_jsonl),
    "parquet": Source(suffix=".parquet", label="parquet", folder=parquet_files,
                      folder_label="parquet folder", document_keys=readers.parquet_keys,
                      read=readers.read_parquet, text_bytes=readers.parquet_text_bytes),
    "files": Source(catch_all=True, label="text file", folder=text_files,
                    folder_label="folder", document_keys=readers.file_keys,
                    read=readers.read_files),
}


def in_order() -> list[tuple[str, Source]]:
    """The entries in the order find_corpus tries them: the table's, catch-alls last."""
    return sorted(SOURCES.items(), key=lambda item: item[1].catch_all)
