"""Data: corpora, tokenizers, cached token streams and batches for training.

    ds = load_dataset(DataConfig(), run_dir="runs/x", vocab_size=cfg.vocab_size)
    batch = get_batch(ds.train, ds.train_docs, seed=0, step=k, batch_size=8, seq_len=256)
    for batch in eval_batches(ds.val, ds.val_docs, batch_size=8, seq_len=256): ...
    prepare(DataConfig(path="big.jsonl", tokenizer="bpe"), out="/data/tok")  # then path=
"""

from jaxformer.data.batches import eval_batches, get_batch
from jaxformer.data.config import DataConfig, DataError
from jaxformer.data.corpus import Corpus, find_corpus, stdlib_corpus
from jaxformer.data.dataset import Dataset, load_dataset
from jaxformer.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "DataError",
    "Dataset",
    "HFTokenizer",
    "Tokenizer",
    "eval_batches",
    "find_corpus",
    "get_batch",
    "load_dataset",
    "load_tokenizer",
    "prepare",
    "stdlib_corpus",
    "train_bpe",
]


def __getattr__(name: str):
    """`prepare`, imported when first asked for: importing it here would put
    jaxformer.data.prepare in sys.modules before `python -m jaxformer.data.prepare` runs it
    (runpy's RuntimeWarning)."""
    if name == "prepare":
        from jaxformer.data.prepare import prepare
        globals()["prepare"] = prepare  # not the submodule, which its import bound here
        return prepare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
