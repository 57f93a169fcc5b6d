"""Random text, plain-Python references and corpus writers shared by the data tests."""

import hashlib
import pathlib

import numpy as np
import pytest

from jaxformer.data import corpus as corpus_module
from jaxformer.data import tokens as tokens_module


EOT = "<|endoftext|>"
# ASCII (weighted), Latin-1, Greek, CJK, emoji: 1- to 4-byte UTF-8
_RANGES = [(0x20, 0x7E)] * 6 + [(0x0A, 0x0A), (0xA0, 0xFF), (0x391, 0x3C9), (0x4E00, 0x4E80),
                                 (0x1F600, 0x1F640)]


def random_text(rng, n: int) -> str:
    lo_hi = [_RANGES[i] for i in rng.integers(0, len(_RANGES), n)]
    return "".join(chr(int(rng.integers(lo, hi + 1))) for lo, hi in lo_hi)


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def reference_val(keys, val_fraction):
    """Plain restatement of the split rule: the round-half-up(fraction * n) keys (at least
    1, at most n - 1) with the smallest sha256 go to val."""
    n_val = min(max(1, int(val_fraction * len(keys) + 0.5)), len(keys) - 1)
    ranked = sorted(keys, key=lambda k: (hashlib.sha256(k.encode()).digest(), k))
    return set(ranked[:n_val])


def offsets(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths))]


def files_in(folder):
    root = pathlib.Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _wordlevel_tokenizer(tmp_path, n_words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {EOT: 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, n_words)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([EOT])
    path = tmp_path / "wordlevel.json"
    path.write_text(hf.to_str())
    return path


def killed_writer(final: str) -> tuple[str, int]:
    """The temporary folder of `final` that a writer killed with SIGKILL left behind
    (a child process makes it, writes half a file, and is killed), and its pid."""
    import signal
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from jaxformer.data.tokens import temporary_path\n"
        f"tmp = temporary_path({final!r}); os.makedirs(tmp)\n"
        "open(os.path.join(tmp, 'train.bin'), 'wb').write(b'half')\n"
        "print(tmp, flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    dead = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    return dead, child.pid


def random_lines(rng, n_chars: int) -> str:
    """Lines of random 1- to 4-byte characters (fast: drawn as arrays), each between two
    ASCII letters, so that a line end is a clean cut (see corpus.cut_point)."""
    lo, hi = np.array(_RANGES).T
    which = rng.integers(0, len(_RANGES), n_chars)
    cps = lo[which] + (rng.random(n_chars) * (hi[which] - lo[which] + 1)).astype(np.int64)
    body = "".join(map(chr, cps.tolist())).replace("\n", " ")
    ends = np.cumsum(rng.integers(1, 300, n_chars // 40))
    ends = ends[ends < len(body)]
    return "\n".join(f"a{body[i:j]}z" for i, j in zip(np.r_[0, ends], np.r_[ends, len(body)]))


def small_pieces(monkeypatch, piece: int, batch: int):
    monkeypatch.setattr(corpus_module, "PIECE_CHARS", piece)
    monkeypatch.setattr(tokens_module, "BATCH_CHARS", batch)


def write_parquet(path, columns, row_group_size):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
