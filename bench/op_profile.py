"""Where the train step's forward+backward spends its time, by compiled op.

    python bench/op_profile.py [--shape gpt2|llama --layers 6 --d-model 384 --heads 6
        --kv-heads 2 --seq 256 --batch 8 --vocab 256 --dtype float32 --calls 3 --top 25]
        [--forward] [model.key=value ...]

Traces `jax.value_and_grad` of the training loss with `jax.profiler` and sums the trace's
events by compiled op (`ynn_fusion.N` is a matmul, `copy_bitcast_fusion.N` a transpose,
...). Prints the time by kind of op, then by the jax op each came from, layers folded
(e.g. `bwd block_*/ffn/wi/dot_general`), with GFLOP/s for dots. The same shapes and
overrides as bench/train_throughput.py. XLA:CPU may run independent ops at the same time
on different cores, and matmuls hand work to a thread pool the trace does not show, so
per-op times only bound each op: take step times from train_throughput.py. Prints
tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import tempfile
import time

import jax
import numpy as np
from perfetto import trace_events as perfetto_events
from train_throughput import add_size_arguments, model_config

from jaxformer import Transformer
from jaxformer.training.config import parse_overrides
from jaxformer.training.step import loss_sums


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt2", help="gpt2 or llama (bench/train_throughput.py)")
    add_size_arguments(p)
    p.add_argument("--calls", type=int, default=3, help="traced calls (after one warm-up)")
    p.add_argument("--top", type=int, default=25, help="ops to list")
    p.add_argument("--forward", action="store_true", help="the forward pass only")
    return p.parse_args()


INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (\w[\w\-]*)\(([^)]*)\)")


def _dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(lines: list[str], shapes: dict) -> float:
    """FLOPs of the dot among an op's lines (0 if none): 2 * |out| * |contracted|; shapes:
    every instruction's dims, for the dot's operands."""
    for line in lines:
        m = INSTRUCTION.match(line)
        if m and m.group(3) == "dot":
            lhs = shapes.get(m.group(4).split(",")[0].strip().lstrip("%"), [])
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
            k = math.prod(lhs[int(d)] for d in contract.split(",") if d) if lhs else 0
            return 2.0 * math.prod(_dims(m.group(2))) * k
    return 0.0


def hlo_ops(hlo_text: str) -> dict:
    """Instruction name -> (result shape, where it comes from, FLOPs if a dot) from
    optimized HLO text; where: "bwd"/"fwd" and the jax op's name path (e.g.
    block_0/ffn/wi/dot_general). A fusion's FLOPs are those of the dot it calls."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(", line)
        if head and not line.startswith(" "):
            current = computations.setdefault(head.group(1), [])
        elif current is not None:
            current.append(line)
    lines = [line for body in computations.values() for line in body]
    shapes = {m.group(1): _dims(m.group(2)) for m in map(INSTRUCTION.match, lines) if m}
    ops = {}
    for line in lines:
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, _ = m.groups()
        called = re.search(r"calls=%?([\w.\-]+)", line)
        flops = _dot_flops(computations.get(called.group(1), []) if called else [line], shapes)
        source = re.search(r'op_name="([^"]*)"', line)
        source = source.group(1) if source else op
        phase = "bwd" if "transpose(" in source else "fwd"
        where = re.sub(r"^.*\)/", "", source.split(";")[0])
        ops.setdefault(name, (shape, f"{phase} {where}", flops))
    return ops


def trace_events(trace_dir: str) -> collections.Counter:
    """Sum of each event name's durations (ms) over the trace's complete ("X") events."""
    total = collections.Counter()
    for e in perfetto_events(trace_dir):
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"] / 1e3
    return total


def main():
    a = parse_args()
    cfg = model_config(a.shape, a, parse_overrides(a.overrides))
    model = Transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.seq + 1), np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((a.batch, a.seq), np.float32)}
    params = model.init(jax.random.key(0), data["inputs"][:1])["params"]
    loss = lambda p: loss_sums(model, p, data)[0]  # noqa: E731
    fn = jax.jit(loss if a.forward else jax.value_and_grad(loss))
    compiled = fn.lower(params).compile()
    ops = hlo_ops(compiled.as_text())
    jax.block_until_ready(compiled(params))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(a.calls):
                jax.block_until_ready(compiled(params))
        wall = (time.perf_counter() - t0) * 1e3 / a.calls
        totals = trace_events(tmp)
    known = {n: ms / a.calls for n, ms in totals.items() if n in ops}
    busy = sum(known.values())
    what = "forward" if a.forward else "forward+backward"
    print(f"[{a.shape}] {what}: {wall:.1f} ms per call traced (wall, tracing on); compiled ops "
          f"busy {busy:.1f} ms per call; {len(known)} ops\n")
    by_kind = collections.Counter()
    for n, ms in known.items():
        by_kind[re.sub(r"[.\d]+$", "", n)] += ms
    print(f"{'kind':<32} {'ms':>8} {'share':>6}")
    for kind, ms in by_kind.most_common(12):
        print(f"{kind:<32} {ms:>8.1f} {ms / busy:>6.1%}")

    by_source = collections.defaultdict(lambda: [0.0, 0, 0.0])  # ms, ops, flops
    for n, ms in known.items():
        _, where, flops = ops[n]
        row = by_source[re.sub(r"block_\d+/", "block_*/", where)]
        row[0] += ms
        row[1] += 1
        row[2] += flops
    print(f"\n{'source (all layers)':<58} {'ops':>4} {'ms':>8} {'share':>6} {'GFLOP/s':>8}")
    for where, (ms, count, flops) in sorted(by_source.items(), key=lambda kv: -kv[1][0])[:a.top]:
        rate = f"{flops / ms / 1e6:8.1f}" if flops else f"{'':>8}"
        print(f"{where[:58]:<58} {count:>4} {ms:>8.1f} {ms / busy:>6.1%} {rate}")


if __name__ == "__main__":
    main()
