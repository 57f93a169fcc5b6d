"""load_dataset: corpus -> tokenizer -> train/val token arrays, as memmaps.

A text corpus is tokenised once into a token folder in the cache (see
``jaxformer.data.tokens``: splits, streaming, the folder's files) that later runs map
again; a folder written by ``python -m jaxformer.data.prepare``, and nanoGPT-style .bin
token files, are mapped in place (as their entries in ``jaxformer.data.sources`` say).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np

from jaxformer.data.batches import eval_batches, get_batch
from jaxformer.data.completions import CompletionData
from jaxformer.data.config import DataConfig, DataError
from jaxformer.data.corpus import Corpus, find_corpus
from jaxformer.data.mixture import MixtureData, load_mixture
from jaxformer.data.seq2seq import Seq2SeqData
from jaxformer.data.seq2seq_tasks import task_file
from jaxformer.data.token_files import open_tokens
from jaxformer.data.tokenizer import Tokenizer, load_tokenizer
from jaxformer.data.tokens import (
    CACHE_VERSION,
    cache_key,
    remove_stale_temporaries,
    to_stderr,
    write_tokens,
)


@dataclasses.dataclass
class Dataset:
    """train/val: 1-D read-only token ids (np.memmap: uint8 for bytes, uint16 or uint32) [n_tokens].
    train_docs/val_docs: int64 [n_docs] start offset of each document (first is 0;
    empty when the split is)."""

    train: np.ndarray
    val: np.ndarray
    train_docs: np.ndarray
    val_docs: np.ndarray
    tokenizer: Tokenizer
    source: str

    @property
    def token_counts(self) -> tuple[int, int]:
        return len(self.train), len(self.val)

    def train_batch(self, *, seed: int, step: int, batch_size: int, seq_len: int,
                    pack: bool = False, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """get_batch over the train split (a pure function of seed and step)."""
        return get_batch(self.train, self.train_docs, seed=seed, step=step,
                         batch_size=batch_size, seq_len=seq_len, pack=pack, rows=rows)

    def eval_batches(self, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                     pack: bool = False, rows: slice = slice(None)):
        """eval_batches over the val split."""
        return eval_batches(self.val, self.val_docs, batch_size=batch_size, seq_len=seq_len,
                            max_batches=max_batches, pack=pack, rows=rows)


def load_dataset(cfg: DataConfig, *, run_dir: str | None = None,
                 vocab_size: int | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None
                 ) -> Dataset | CompletionData | Seq2SeqData | MixtureData:
    """The train/val token streams that ``cfg`` describes.

    run_dir: where the tokenizer is saved as tokenizer.json (required for "bpe"; a
      tokenizer.json already there, from the run being resumed, is reused for "bpe" and
      must match for the other settings).
    vocab_size: the model's; raises DataError if the tokenizer or any token id does
      not fit (JAX would silently clamp an out-of-range id in the embedding lookup).
    progress: show progress bars (on stderr) for BPE training and tokenising; pass
      False on every process but the first.
    log: takes one-line messages (the cache used, the BPE sample); default: stderr.
    """
    log = log or to_stderr
    if cfg.mixture:  # each source as data.path would be; one tokenizer
        return load_mixture(cfg, load_dataset, run_dir=run_dir, vocab_size=vocab_size,
                            progress=progress, log=log)
    cache_dir = os.path.expanduser(cfg.cache_dir or "~/.cache/jaxformer")
    fmt = cfg.format_entry
    if cfg.path in fmt.tasks:  # generated, written once, with the format's default fields
        cfg = cfg.replace(path=task_file(cfg.path, cache_dir),
                          **dict(fmt.settings().by_key()))
    corpus = find_corpus(cfg.path)
    for name, pid in remove_stale_temporaries(cache_dir):
        log(f"data: removed {os.path.join(cache_dir, name)}, left by process {pid}, which "
            "is gone")
    tokenizer = _choose_tokenizer(cfg, corpus, run_dir, cache_dir, progress, log)
    if fmt.records:  # read by the format, not a corpus
        data = fmt.load(cfg, tokenizer, vocab_size, log)
        _check_ids(cfg, data, data.max_id, vocab_size)
        return data
    if corpus.source.holds_text:
        ds, max_id = _tokenized_text(cfg, corpus, tokenizer, cache_dir, progress, log)
    else:  # token ids, mapped in place
        arrays, max_id = corpus.source.map_tokens(cfg, corpus, tokenizer)
        ds = Dataset(**arrays, tokenizer=tokenizer, source=corpus.describe())
    _check_ids(cfg, ds, max_id, vocab_size)
    return ds


# ---- tokenizer ------------------------------------------------------------------------

def _choose_tokenizer(cfg: DataConfig, corpus: Corpus, run_dir: str | None, cache_dir: str,
                      progress: bool, log) -> Tokenizer:
    """The run's tokenizer, saved into run_dir; a resumed run's saved one must match."""
    saved_path = os.path.join(run_dir, "tokenizer.json") if run_dir is not None else None
    saved = load_tokenizer(saved_path) if saved_path and os.path.isfile(saved_path) else None
    trains = cfg.tokenizer_entry.trains and corpus.source.tokenizer is None
    if trains and run_dir is None:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} trains a tokenizer that the run "
                        "must keep, but no run_dir was given; pass run_dir to load_dataset, "
                        "or set data.tokenizer to an existing tokenizer.json")
    if trains and saved is not None:
        tokenizer = saved
    else:
        tokenizer = new_tokenizer(cfg, corpus, cache_dir, progress, log)
    if saved is not None and saved.fingerprint != tokenizer.fingerprint:
        raise DataError(f"{saved_path} holds {saved!r}, which this run was started with, but "
                        f"data.tokenizer={cfg.tokenizer!r} gives {tokenizer!r}; set "
                        f"data.tokenizer={saved_path!r} to continue the run, or use a new run dir")
    if run_dir is not None and saved is None:
        tokenizer.save(run_dir)
    return tokenizer


def new_tokenizer(cfg: DataConfig, corpus: Corpus, cache_dir: str, progress: bool = True,
                  log=None) -> Tokenizer:
    """What data.tokenizer names (its kind's make: bytes, a BPE trained on the corpus or
    found in the cache, a tokenizer.json); the tokenizer a token source comes with (a
    prepared folder's own)."""
    if corpus.source.tokenizer is not None:
        return corpus.source.tokenizer(cfg, corpus)
    return cfg.tokenizer_entry.make(cfg, corpus, cache_dir, progress, log or to_stderr)


# ---- text corpora: tokenise once into the cache ----------------------------------------

def _tokenized_text(cfg: DataConfig, corpus: Corpus, tokenizer: Tokenizer, cache_dir: str,
                    progress: bool, log) -> tuple[Dataset, int]:
    key = cache_key(["tokens", CACHE_VERSION, corpus.kind, corpus.fingerprint(), cfg.text_field,
                 cfg.val_fraction, tokenizer.fingerprint])
    final = os.path.join(cache_dir, f"tokens-{key}")
    if os.path.isdir(final):
        ds, max_id = _open_folder(final, tokenizer, corpus.describe())
        log(f"data: tokens from the cache, {final}")
        return ds, max_id
    write_tokens(final, cfg, corpus, tokenizer, progress=progress, log=log)
    return _open_folder(final, tokenizer, corpus.describe())


def _open_folder(folder: str, tokenizer: Tokenizer, source: str) -> tuple[Dataset, int]:
    meta, arrays = open_tokens(folder)
    return Dataset(**arrays, tokenizer=tokenizer, source=source), meta["max_id"]


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
        key = cfg.tokenizer_entry.vocab_key
        hint = f" or data.{key} <= {vocab_size}" if key else ""
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size="
                        f"{vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}{hint}")
