"""The data pipeline on a generated text file: peak memory, MB/s, and the share of a bare
``encode_batch`` that the whole pipeline (read, cut, encode, write) keeps.

    python bench/data.py [--mb 1000] [--tokenizers bytes,bpe] [--dir DIR] [--bare-mb N]

The file is the Python standard library's source, written over and over until it has
--mb megabytes; every copy after the first has its letters put through its own random
substitution (a-z, A-Z), so the words keep their statistics but are new words, as in a
corpus that keeps growing, not one repeated (a repeated one flatters BPE training and
caching). Nothing is downloaded.

Each stage runs in a fresh process, so that its peak RSS (VmHWM) is its own:
  bpe-train  BPE trained on the default bounded sample (data.bpe_train_bytes);
  tokenise   load_dataset's streaming writer into a fresh cache, timing the tokenizer's
             own calls inside it (hf encode_batch_fast, or ByteTokenizer.encode_batch);
  bare       the same pieces, in the same batches, through plain ``encode_batch`` (with
             offsets, what most code calls) and nothing else: no reading or writing timed.
"in-run" is the pipeline's MB/s over the MB/s of its own tokenizer calls; "vs
encode_batch" is over the bare pass's. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import string
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np


def make_corpus(path: str, n_bytes: int) -> None:
    base = b"".join(_stdlib_sources())
    with open(path + ".tmp", "wb") as f:
        written, k = 0, 0
        while written < n_bytes:
            part = (base if k == 0 else base.translate(_cipher(k)))[:n_bytes - written]
            f.write(part)
            written, k = written + len(part), k + 1
    os.replace(path + ".tmp", path)


def _stdlib_sources():
    root = sysconfig.get_paths()["stdlib"]
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages",
                                                      "__pycache__"))
        for name in sorted(names):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    yield f.read()


def _cipher(k: int) -> bytes:
    p = np.random.default_rng(k).permutation(26)
    lo, up = string.ascii_lowercase.encode(), string.ascii_uppercase.encode()
    return bytes.maketrans(lo + up, bytes(lo[i] for i in p) + bytes(up[i] for i in p))


# ---- the stages, each in its own process -------------------------------------------------

def stage(name: str, file: str, tokenizer: str, work: str, bare_mb: float) -> dict:
    from jaxformer.data import DataConfig
    from jaxformer.data.corpus import find_corpus, read_pieces
    from jaxformer.data.dataset import new_tokenizer
    from jaxformer.data.tokenizer_kinds import tokenizer_kind
    from jaxformer.data.tokens import _batches, write_tokens

    corpus = find_corpus(file)
    cfg = DataConfig(path=file, tokenizer=tokenizer, cache_dir=os.path.join(work, "cache"))
    out = {"stage": name, "tokenizer": tokenizer_kind(tokenizer)}  # main names a trained one
    started = time.perf_counter()
    if name == "bpe-train":
        new_tokenizer(cfg, corpus, cfg.cache_dir, progress=False, log=lambda m: None)
        out.update(mb=min(cfg.bpe_train_bytes, corpus.n_bytes()) / 1e6)
    elif name == "tokenise":
        tok = new_tokenizer(cfg, corpus, cfg.cache_dir, progress=False)
        inside = _time_calls(tok)
        write_tokens(os.path.join(work, f"tokens-{out['tokenizer']}"), cfg, corpus, tok,
                     progress=False, log=lambda m: None)
        out.update(mb=corpus.n_bytes() / 1e6, encode_s=inside[0])
    else:  # bare
        tok = new_tokenizer(cfg, corpus, cfg.cache_dir, progress=False)
        encode = tok.hf.encode_batch if hasattr(tok, "hf") else tok.encode_batch
        seconds = chars = 0
        for batch in _batches(read_pieces(corpus)):
            texts = [p.text for p in batch]
            t = time.perf_counter()
            encode(texts, add_special_tokens=False) if hasattr(tok, "hf") else encode(texts)
            seconds += time.perf_counter() - t
            chars += sum(map(len, texts))
            if chars >= bare_mb * 1e6:
                break
        out.update(mb=chars / 1e6, encode_s=seconds)
        started = time.perf_counter() - seconds
    out.update(seconds=time.perf_counter() - started, rss_mb=_peak_rss_mb())
    return out


def _peak_rss_mb() -> float:
    """This program's peak RSS: VmHWM on Linux (ru_maxrss would also count the process
    this one was forked from: Linux keeps the larger across exec)."""
    try:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_calls(tok) -> list[float]:
    """Wraps the tokenizer's own batch call so that its seconds add up in the list."""
    total = [0.0]
    target = tok.hf if hasattr(tok, "hf") else tok
    name = "encode_batch_fast" if hasattr(target, "encode_batch_fast") else "encode_batch"
    inner = getattr(target, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t

    if hasattr(tok, "hf"):
        class Timed:  # the Rust object's methods cannot be replaced: stand in front of it
            def __getattr__(self, attr):
                return timed if attr == name else getattr(target, attr)
        tok.hf = Timed()
    else:
        tok.encode_batch = timed
    return total


def run_stage(name, file, tokenizer, work, bare_mb) -> dict:
    cmd = [sys.executable, __file__, "--stage", name, "--file", file, "--tokenizers", tokenizer,
           "--work", work, "--bare-mb", str(bare_mb)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=1000)
    p.add_argument("--tokenizers", default="bytes,bpe")
    p.add_argument("--dir", default=os.path.expanduser("~/.cache/jaxformer/bench"))
    p.add_argument("--bare-mb", type=float, default=float("inf"),
                   help="stop the bare encode_batch pass after this many MB")
    p.add_argument("--stage"), p.add_argument("--file"), p.add_argument("--work")
    a = p.parse_args()
    if a.stage:
        print(json.dumps(stage(a.stage, a.file, a.tokenizers, a.work, a.bare_mb)))
        return
    os.makedirs(a.dir, exist_ok=True)
    file = os.path.join(a.dir, f"corpus-{a.mb:g}MB.txt")
    if not os.path.isfile(file) or os.path.getsize(file) != int(a.mb * 1e6):
        t = time.perf_counter()
        make_corpus(file, int(a.mb * 1e6))
        print(f"generated {file} in {time.perf_counter() - t:.1f} s")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor()) \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"{a.mb:g} MB of text; {os.cpu_count()} cores ({cpu}); BATCH/PIECE chars from "
          "jaxformer.data.tokens")
    from jaxformer.data.tokenizer_kinds import TOKENIZERS, tokenizer_kind

    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as work:
        for label in a.tokenizers.split(","):
            tok = label
            if TOKENIZERS[tokenizer_kind(label)].trains:  # then tokenise with what it trained
                rows.append(run_stage("bpe-train", file, label, work, a.bare_mb))
                tok = next(os.path.join(work, "cache", n)
                           for n in os.listdir(os.path.join(work, "cache")) if n.startswith("bpe-"))
            rows += [{**run_stage(stage, file, tok, work, a.bare_mb), "tokenizer": label}
                     for stage in ("tokenise", "bare")]
    print(_table(rows))


def _table(rows) -> str:
    lines = ["| tokenizer | stage | MB | seconds | MB/s | peak RSS MB | in-run | vs encode_batch |",
             "|---|---|---|---|---|---|---|---|"]
    bare = {r["tokenizer"]: r["mb"] / r["encode_s"] for r in rows if r["stage"] == "bare"}
    for r in rows:
        rate = r["mb"] / r["seconds"]
        inrun = vs = ""
        if r["stage"] == "tokenise":
            inrun = f"{r['encode_s'] / r['seconds']:.2f}"
            vs = f"{rate / bare[r['tokenizer']]:.2f}" if r["tokenizer"] in bare else ""
        lines.append(f"| {r['tokenizer']} | {r['stage']} | {r['mb']:.0f} | {r['seconds']:.1f} | "
                     f"{rate:.1f} | {r['rss_mb']:.0f} | {inrun} | {vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
