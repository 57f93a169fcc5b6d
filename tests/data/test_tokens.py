"""The token cache (jaxformer.data.tokens) against re-tokenising, killed writers, RSS, disk."""

import os

import numpy as np
import pytest

from jaxformer.data import DataConfig, DataError, load_dataset, train_bpe
from jaxformer.data import tokenizer as tokenizer_module
from jaxformer.data import tokens as tokens_module
from tests.data.helpers import (
    _wordlevel_tokenizer,
    files_in,
    killed_writer,
    random_lines,
    random_text,
    reference_val,
    small_pieces,
)


# ---- the cache ----------------------------------------------------------------------------

def _folder(rng, root, n=5):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i}.txt").write_text(random_text(rng, 200), encoding="utf-8")
    return root


def test_cache_is_reused_and_written_atomically(rng, tmp_path, monkeypatch):
    root, cache = _folder(rng, tmp_path / "corpus"), tmp_path / "cache"
    cfg = DataConfig(path=str(root), cache_dir=str(cache), val_fraction=0.2)
    first = load_dataset(cfg)
    assert [p.split("/")[0] for p in files_in(cache)] == [os.listdir(cache)[0]] * 5
    assert not any("tmp" in p for p in files_in(cache))

    def fail(*args, **kwargs):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(tokenizer_module.ByteTokenizer, "encode", fail)
    monkeypatch.setattr(tokenizer_module.ByteTokenizer, "encode_batch", fail)
    again = load_dataset(cfg)
    np.testing.assert_array_equal(first.train, again.train)
    np.testing.assert_array_equal(first.val, again.val)

    # a changed source file is a new cache entry; a failure while writing it leaves nothing
    (root / "f0.txt").write_text("changed", encoding="utf-8")
    with pytest.raises(AssertionError, match="re-tokenized"):
        load_dataset(cfg)
    assert len(os.listdir(cache)) == 1 and not any("tmp" in p for p in files_in(cache))
    monkeypatch.undo()
    changed = load_dataset(cfg)
    assert len(os.listdir(cache)) == 2 and not any("tmp" in p for p in files_in(cache))
    assert b"changed" in bytes(np.concatenate([changed.train, changed.val]).astype(np.uint8))


def test_killed_tokenisation_leaves_a_folder_the_next_run_removes(rng, tmp_path, capsys):
    """A writer killed with SIGKILL leaves its temporary folder; the next load removes it,
    and keeps a live process's folder and another host's."""
    import socket
    cache, final = tmp_path / "cache", str(tmp_path / "cache" / "tokens-abc")
    dead, pid = killed_writer(final)
    assert os.path.isdir(dead)
    host = socket.gethostname()
    live = f"{final}.tmp-{host}-{os.getpid()}-{rng.bytes(4).hex()}"
    other = f"{final}.tmp-not-{host}-{pid}-{rng.bytes(4).hex()}"
    for folder in (live, other):
        os.makedirs(folder)
    (tmp_path / "hi.txt").write_text("hello, world")
    load_dataset(DataConfig(path=str(tmp_path / "hi.txt"), cache_dir=str(cache)))
    assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isdir(other)
    assert f"data: removed {dead}, left by process {pid}, which is gone" in \
        capsys.readouterr().err


# ---- text of any size: pieces, memory, speed's plumbing ------------------------------------

_RSS_CHILD = """
import sys
from jaxformer.data import DataConfig, corpus, load_dataset, tokens
corpus.PIECE_CHARS, tokens.BATCH_CHARS = int(sys.argv[4]), int(sys.argv[5])
ds = load_dataset(DataConfig(path=sys.argv[1], tokenizer=sys.argv[2], cache_dir=sys.argv[3]),
                  progress=False, log=lambda m: None)
assert len(ds.train) > 0
# the peak RSS of this program: ru_maxrss would also count the pytest process it was forked
# from (Linux keeps the larger across exec)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_peak_memory_stays_flat_as_the_file_grows(rng, tmp_path):
    """Peak RSS of a fresh process tokenising a file 4x as large grows by less than half
    the extra text with bytes, and by less than the extra text with a BPE tokenizer.json
    (its allocator's working set creeps up a little before it settles). Pieces and batches
    are a quarter of the defaults (bytes) or smaller (BPE), so that files of a few MB are
    many batches. Whole files used to be read and encoded at once: 11x the file with
    bytes, ~100x with BPE."""
    import subprocess
    import sys
    block = random_lines(rng, 500_000).encode("utf-8")
    tok = train_bpe(iter([block[:200_000].decode("utf-8", "replace")]), 300)
    tok.save(tmp_path / "tok")
    for tokenizer, small, piece, batch, share in (("bytes", 2e6, 1 << 17, 1 << 20, 0.5),
                                                  (str(tmp_path / "tok"), 1e6, 1 << 12,
                                                   1 << 14, 1.0)):
        peak = []
        for size in (small, 4 * small):
            path = tmp_path / f"{int(size)}.txt"
            path.write_bytes(block * int(size // len(block) + 1))
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), tokenizer,
                                  str(tmp_path / "cache"), str(piece), str(batch)],
                                 capture_output=True, text=True, check=True).stdout
            peak.append(int(out.split()[-1]) * 1024)
        extra = os.path.getsize(tmp_path / f"{int(4 * small)}.txt") - \
            os.path.getsize(tmp_path / f"{int(small)}.txt")
        assert peak[1] - peak[0] < share * extra, (tokenizer, peak, extra)


def test_progress_bars_and_one_line_on_a_cache_hit(rng, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tokens_module, "BAR_DELAY", 0)
    (tmp_path / "t.txt").write_text(random_lines(rng, 50_000), encoding="utf-8")
    cfg = DataConfig(path=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "c"))
    logged = []
    load_dataset(cfg, progress=False, log=logged.append)
    assert "data: tokenising" not in capsys.readouterr().err
    assert len(logged) == 1 and logged[0].startswith("data: tokenised text file")
    load_dataset(cfg.replace(val_fraction=0.1), log=logged.append)
    assert "data: tokenising" in capsys.readouterr().err  # tqdm: MB, MB/s and ETA
    load_dataset(cfg, log=logged.append)
    assert len(logged) == 3 and logged[2].startswith("data: tokens from the cache, ")


def test_not_enough_disk_is_refused_before_tokenising_much(rng, tmp_path, monkeypatch):
    import collections
    small_pieces(monkeypatch, piece=20_000, batch=60_000)
    (tmp_path / "t.txt").write_text(random_lines(rng, 400_000), encoding="utf-8")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(tokens_module.shutil, "disk_usage", lambda p: usage(10**9, 0, 50_000))
    cache = tmp_path / "c"
    with pytest.raises(DataError, match=r"needs about 0.00\d* GB more in .*c, but 0.00 GB is "
                                         "free; free some space, or set data.cache_dir"):
        load_dataset(DataConfig(path=str(tmp_path / "t.txt"), cache_dir=str(cache)))
    assert os.listdir(cache) == []  # no tokens, no temporary folder


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_disk_estimate_counts_the_token_dtype_bytes(rng, tmp_path, monkeypatch, dtype):
    """The free-space check after the first batch counts tokens in their dtype's bytes (2
    or 4 each, not 1 as for byte tokens): at the first batch's rate, the rest needs
    (tokens so far x itemsize) / (text bytes so far) x (text bytes to come), here by
    hand from word counts (a word-level tokenizer: one token a word, an eot a file). A
    disk with 10% less free than that is refused before the tokens are written; one with
    20% more is used."""
    import collections
    n_words = 70_000 if dtype == "uint32" else int(rng.integers(300, 60_000))
    tokenizer = str(_wordlevel_tokenizer(tmp_path, n_words))
    root = tmp_path / "corpus"
    root.mkdir()
    n_files = int(rng.integers(6, 12))
    counts, sizes = [], []
    for i in range(n_files):
        words = [f"w{w}" for w in rng.integers(2, n_words, int(rng.integers(20, 200)))]
        text = "".join(w + str(rng.choice([" ", "\n", "  "])) for w in words)
        (root / f"d{i:02d}.txt").write_text(text)
        counts.append(len(words) + 1)
        sizes.append(len(text))
    first = int(rng.integers(1, n_files - 1))
    monkeypatch.setattr(tokens_module, "_BATCH_PIECES", first)  # the first batch: `first` files
    need = (sum(counts[:first]) * np.dtype(dtype).itemsize / sum(sizes[:first])
            * sum(sizes[first:]))
    usage = collections.namedtuple("usage", "total used free")
    cache = tmp_path / "c"
    cfg = DataConfig(path=str(root), tokenizer=tokenizer, val_fraction=0.0, cache_dir=str(cache))
    monkeypatch.setattr(tokens_module.shutil, "disk_usage",
                        lambda p: usage(10**12, 0, int(0.9 * need)))
    with pytest.raises(DataError, match=r"needs about \d+\.\d\d GB more in .*c, but \d+\.\d\d GB "
                                         "is free; free some space"):
        load_dataset(cfg)
    assert os.listdir(cache) == []
    monkeypatch.setattr(tokens_module.shutil, "disk_usage",
                        lambda p: usage(10**12, 0, int(1.2 * need) + 1))
    ds = load_dataset(cfg)
    assert ds.train.dtype == np.dtype(dtype) and len(ds.train) == sum(counts)


# ---- text that holds nothing to train on --------------------------------------------------

def test_empty_or_whitespace_text_is_refused_with_its_own_fix(rng, tmp_path):
    """An empty file has no text; a file of whitespace holds only whitespace (not trained
    on); lowering data.val_fraction is offered only where it helps: text that all went to
    val."""
    cache = str(tmp_path / "c")
    blank = "".join(rng.choice(list(" \t\n\r\x0b\x0c\u00a0\u3000"), int(rng.integers(1, 3000))))
    (tmp_path / "blank.txt").write_text(blank, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("")
    for name, problem in (("blank.txt", "holds only whitespace; add text"),
                          ("empty.txt", "has no text; add text (empty documents are skipped)")):
        with pytest.raises(DataError) as err:
            load_dataset(DataConfig(path=str(tmp_path / name), cache_dir=cache))
        message = str(err.value)
        assert message.startswith(f"text file {tmp_path / name} (") and "\n" not in message
        assert message.endswith(f") {problem}"), message
    root = tmp_path / "two"
    root.mkdir()
    val = reference_val(["a.txt", "b.txt"], 0.5)
    for name in ("a.txt", "b.txt"):
        (root / name).write_text(random_text(rng, 100) + "x" if name in val else "")
    with pytest.raises(DataError, match=r"has no text for the train split; add text \(empty "
                                        r"documents are skipped\) or lower data.val_fraction$"):
        load_dataset(DataConfig(path=str(root), cache_dir=cache, val_fraction=0.5))
