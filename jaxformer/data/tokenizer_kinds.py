"""The kinds of tokenizer data.tokenizer chooses, one entry each in TOKENIZERS: its
settings, how it is made (built, trained on the corpus or loaded), and what the run does
with it. ``tokenizer_kind(value)`` says which entry a data.tokenizer value chooses: a
kind's own name (bytes, bpe), or a value a kind claims (the path of a tokenizer.json, or
of a folder holding one). Whatever the kind, the run saves its tokenizer into the run
dir as tokenizer.json (jaxformer.data.dataset)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Callable, Iterator

from jaxformer.core.validation import ConfigError, check_number
from jaxformer.data.corpus import read_pieces
from jaxformer.data.errors import DataError
from jaxformer.data.settings import Settings
from jaxformer.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from jaxformer.data.tokens import CACHE_VERSION, cache_key, progress_bar, split_plan, \
    temporary_path


@dataclasses.dataclass(frozen=True)
class NoSettings(Settings):
    """A kind with no settings of its own."""


@dataclasses.dataclass(frozen=True)
class BpeSettings(Settings):
    """data.tokenizer=bpe: vocab_size (data.bpe_vocab_size, >= 257: 256 bytes +
    <|endoftext|>); train_bytes (data.bpe_train_bytes): about how much of the train split
    it is trained on, a sample spread over all of it (100 MB: ~20 s and ~0.6 GB on 2 cores)."""

    PREFIX = "bpe_"
    vocab_size: int = 4096
    train_bytes: int = 100_000_000

    def __post_init__(self):
        check_number("data", "bpe_vocab_size", self.vocab_size, int, low=257, high=2**32)
        check_number("data", "bpe_train_bytes", self.train_bytes, int, low=1)


@dataclasses.dataclass(frozen=True)
class TokenizerKind:
    """One kind of tokenizer.

    make(cfg, corpus, cache_dir, progress, log) -> the Tokenizer that the DataConfig cfg
      names, for the corpus (trained on it, found in the cache, built or loaded).
    settings: its frozen settings class (jaxformer.data.settings).
    claims(value) -> whether this kind is a data.tokenizer value that names no kind (a
      path); None: it is chosen by its name alone.
    trains: trained on the run's own train split: a resumed run reuses the one saved in
      its run dir, and data that comes as records or mixtures cannot use it.
    fixed: the one tokenizer of this kind, which needs neither data nor a file; None.
    vocab_key: the data key that sets its vocabulary size (named in error hints); None.
    label: how the error that lists the kinds names it (its name when empty).
    """

    make: Callable
    settings: type = NoSettings
    claims: Callable[[str], bool] | None = None
    trains: bool = False
    fixed: Tokenizer | None = None
    vocab_key: str | None = None
    label: str = ""

    @property
    def is_path(self) -> bool:
        """data.tokenizer is the path of this tokenizer (the kind claims it)."""
        return self.claims is not None


def tokenizer_kind(value) -> str:
    """The name of the TOKENIZERS entry that the data.tokenizer value chooses."""
    if isinstance(value, str):
        if value in TOKENIZERS and TOKENIZERS[value].claims is None:
            return value
        for name, kind in TOKENIZERS.items():
            if kind.claims is not None and kind.claims(value):
                return name
    raise ConfigError(f"data.tokenizer={value!r} is not one of "
                      f"{', '.join(k.label or n for n, k in TOKENIZERS.items())}")


# ---- the kinds' makers ------------------------------------------------------------------

def _bytes(cfg, corpus, cache_dir, progress, log) -> Tokenizer:
    return ByteTokenizer()


def _file(cfg, corpus, cache_dir, progress, log) -> Tokenizer:
    return load_tokenizer(cfg.tokenizer)


def is_tokenizer_file(value: str) -> bool:
    """A tokenizer.json's path (a .json file), or a folder that should hold one."""
    return value.endswith(".json") or os.path.isdir(value)


def trained_bpe(cfg, corpus, cache_dir: str, progress: bool, log) -> Tokenizer:
    """Byte-level BPE trained on a sample of the train split; cached by corpus and
    settings."""
    import tokenizers

    if not corpus.source.holds_text:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} trains on text, but "
                        f"{corpus.describe()} holds token ids; set data.tokenizer to the "
                        "tokenizer.json that made them")
    bpe = BpeSettings.of(cfg)
    key = cache_key(["bpe", CACHE_VERSION, tokenizers.__version__, corpus.kind,
                     corpus.fingerprint(), cfg.text_field, cfg.val_fraction, bpe.vocab_size,
                     bpe.train_bytes])
    path = os.path.join(cache_dir, f"bpe-{key}.json")
    if os.path.isfile(path):
        log(f"data: BPE tokenizer from the cache, {path}")
        return load_tokenizer(path)
    started, sample = time.perf_counter(), _BpeSample(cfg, corpus)
    with progress_bar(progress, sample.target, "BPE sample") as bar:
        tokenizer = train_bpe(sample.texts(bar), bpe.vocab_size)
    log(f"data: trained a {tokenizer.vocab_size}-token BPE on {sample.taken / 1e6:.1f} MB of "
        f"text sampled from the {sample.train / 1e6:.1f} MB train split "
        f"({sample.taken / max(sample.train, 1):.0%}; data.bpe_train_bytes="
        f"{bpe.train_bytes:,}) in {time.perf_counter() - started:.1f} s")
    tmp = temporary_path(os.path.join(cache_dir, f"bpe-{key}"))
    try:
        tokenizer.save(tmp)
        os.replace(os.path.join(tmp, "tokenizer.json"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


class _BpeSample:
    """About data.bpe_train_bytes of the train split's text, spread evenly over all of
    it: a piece is taken while the text taken stays within that budget times the share
    of the split read so far (a single document's train split: its first 1 - val_fraction)."""

    def __init__(self, cfg, corpus):
        self.cfg, self.corpus, self.val = cfg, corpus, split_plan(cfg, corpus)
        self.train = int(corpus.text_bytes(cfg.text_field) * (1 - cfg.val_fraction))
        self.target = min(BpeSettings.of(cfg).train_bytes, self.train)
        self.taken = 0

    def texts(self, bar) -> Iterator[str]:
        read = 0  # bytes of the train split read, up to or past the piece's end
        for piece in read_pieces(self.corpus, self.cfg.text_field):
            if self.val is not None and piece.key in self.val:
                continue
            read += piece.size
            text, last = piece.text, self.val is None and read > self.train
            if last:  # one document: its train split ends inside this piece; keep that part
                keep = max(piece.size - (read - self.train), 0)
                text = text.encode("utf-8")[:keep].decode("utf-8", errors="ignore")
            n = len(text)
            if n and self.taken + n <= self.target * min(read / max(self.train, 1), 1.0):
                self.taken += n
                bar.update(n)
                yield text
                if self.taken >= self.target:
                    return
            if last:
                return


# ---- the table --------------------------------------------------------------------------

TOKENIZERS: dict[str, TokenizerKind] = {
    "bytes": TokenizerKind(make=_bytes, fixed=ByteTokenizer()),  # vocab 256, no separator
    "bpe": TokenizerKind(make=trained_bpe, settings=BpeSettings, trains=True,
                         vocab_key="bpe_vocab_size"),  # saved into the run dir
    "file": TokenizerKind(make=_file, claims=is_tokenizer_file,
                          label="a path to a tokenizer.json, or a folder holding one"),
}
