"""Tokenise a corpus once into a folder that training runs on any number of hosts map:

    python -m jaxformer.data.prepare [configs/NAME.yaml] data.path=... data.tokenizer=bpe out=DIR

DIR then holds train.bin, val.bin, train_docs.npy, val_docs.npy, tokenizer.json and
meta.json; train with ``data.path=DIR`` (its tokenizer comes with it). The data.* keys
are DataConfig's; of a run config file, the data section is used.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

from jaxformer.core.moved import make_callable
from jaxformer.core.validation import (ConfigError, build_section, merge, parse_overrides,
                                       read_config_file)
from jaxformer.data.config import DataConfig, DataError
from jaxformer.data.corpus import find_corpus
from jaxformer.data.dataset import new_tokenizer
from jaxformer.data.tokens import remove_stale_temporaries, to_stderr, write_tokens


def prepare(cfg: DataConfig, out: str, *, progress: bool = True,
            log: Callable[[str], None] | None = None) -> dict:
    """Writes the token folder `out` (which must not exist, or be empty) for `cfg`;
    returns its meta.json."""
    log = log or to_stderr
    if not str(out).strip():  # not the current directory
        raise DataError("out is empty; name the folder to write")
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise DataError(f"out={out} already exists; choose a new folder, or delete it first")
    corpus = find_corpus(cfg.path)
    if not corpus.source.holds_text:
        raise DataError(f"{corpus.describe()} is already token ids; train on it directly "
                        "with data.path")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(parent)  # a killed earlier prepare's, of this host only
    if os.path.isdir(out):
        os.rmdir(out)  # empty: write_tokens renames its folder into place
    cache_dir = os.path.expanduser(cfg.cache_dir or "~/.cache/jaxformer")
    tokenizer = new_tokenizer(cfg, corpus, cache_dir, progress, log)
    meta = write_tokens(out, cfg, corpus, tokenizer, progress=progress, log=log)
    tokenizer.save(out)
    return meta


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    path = argv[0] if argv and "=" not in argv[0] else None
    out = [a.split("=", 1)[1] for a in argv if a.startswith("out=")]
    overrides = [a for a in argv if "=" in a and not a.startswith("out=")]
    stray = [a for a in argv if "=" not in a and a != path]
    wrong = [a for a in overrides if not a.startswith("data.")]
    if stray or wrong or len(out) != 1 or not out[0].strip():
        problem = (f"unexpected argument(s) {' '.join(stray + wrong)}" if stray or wrong
                   else "out=DIR is missing" if not out else "out= is given twice"
                   if len(out) > 1 else "out= is empty; name the folder to write, out=DIR")
        print(f"error: {problem}; usage: python -m jaxformer.data.prepare [config.yaml] "
              "[data.key=value ...] out=DIR", file=sys.stderr)
        return 2
    try:
        meta = prepare(read_data_config(path, overrides), out[0])
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out[0]}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val "
          f"tokens; train with data.path={out[0]}")
    return 0


def read_data_config(path: str | None, overrides: list[str]) -> DataConfig:
    """The data section of a run config file (None: the defaults), data.key=value
    overrides on top, typed and checked as the run's config reader does; the file's
    other sections are the run's, not read here."""
    raw = merge(read_config_file(path), parse_overrides(overrides, ("data",)))
    data = raw.get("data") or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: data must be a mapping of data keys, not "
                          f"{data!r}")
    return build_section(DataConfig, data, "data")


make_callable(__name__, f"{__name__}:prepare")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
