"""Section 10: where a decode step's time goes. generate() of the 1B config (bf16 params and
cache, greedy, batch 1) runs once under jax.profiler; the trace's op events, per decode
step: how many ops ran, the time the device was busy with them (their intervals' union),
the span from the first op's start to the last op's end, and the share of that span with
no op running (launch gaps, host syncs, waits). Then the ops with the most time, their
numbered names folded (`fusion.12` -> `fusion`). This is what stands between section 4's
tokens/s and the memory roofline: a step whose ops are busy 95% of it spends its time in
the kernels themselves (how fast they read), one busy 60% between them. Ops that overlap
(a CPU's thread pool, several streams) make the top ops' shares of busy time sum past 100%.

Op events: on a device process (`/device:GPU:0`, `/device:TPU:0`), the "XLA Ops" line
where the trace has it (a TPU's), else the kernels on its "Stream" lines (a GPU's: the
copies and memsets there counted apart, per step, not as ops); on a trace with no device
process, on XLA:CPU (which runs a program's ops on the calling thread or its pool), the
events named as HLO instructions, control flow aside. On a GPU or TPU whose trace holds no
device events (the profiler could not read the device), the row says so. The traced call
includes the prefill (one forward over the prompt, in the same program), so per step
counts it once among `new_tokens` steps. The same call untraced is timed beside it (the
median of the section's repeats): XLA:GPU launches differently under a trace (its command
buffers, CUDA graphs, are off while profiling unless XLA_FLAGS holds
--xla_enable_command_buffers_during_profiling=true, which the row records), so a traced
step much slower than the untraced one says the trace's gaps are partly its own. The flag
changes nothing outside a trace."""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time

import jax

from gpu_suite.decoding import bf16_model, greedy_call, median_seconds
from gpu_suite.sizes import Sizes, first_line
from gpu_suite.train_step import train_models
from perfetto import trace_events

GRAPHS_TRACED = "--xla_enable_command_buffers_during_profiling=true"

# an XLA:CPU op's event is its HLO instruction's name (`fusion.3`, `ynn_fusion`, `copy.7`);
# Python frames (`$...`) and the runtime's records (`Handle inputs`, `X::Y`) are not, and
# control flow spans its body's ops
HLO_NAME = re.compile(r"^[a-z][\w\-]*(\.\d+)?$")
CONTROL_FLOW = re.compile(r"^(while|conditional|call)\b")
COPY = re.compile(r"^(memcpy|memset)", re.IGNORECASE)  # a stream's copies, not kernels


def op_events(events: list[dict], host_ok: bool = True) -> tuple[list[dict], str]:
    """(the complete events that are the program's ops, where they were taken from); the
    host's events only where host_ok (XLA:CPU: its ops run there), else none."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = \
                e["args"]["name"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = {pid for (pid, tid), n in names.items()
              if tid is None and re.search(r"/device:(GPU|TPU)", n)}
    line = lambda e: names.get((e["pid"], e.get("tid")), "")  # noqa: E731
    for wanted, source in ((lambda n: n == "XLA Ops", "device XLA Ops"),
                           (lambda n: n.startswith("Stream"), "device streams")):
        found = [e for e in complete if e["pid"] in device and wanted(line(e))]
        if found:
            return found, source
    if not host_ok:
        return [], "no device events"
    host = [e for e in complete if e["pid"] not in device
            and HLO_NAME.match(e["name"]) and not CONTROL_FLOW.match(e["name"])]
    return host, "host threads"


def busy_us(events: list[dict]) -> float:
    """The union of the events' [ts, ts + dur) intervals, microseconds."""
    total, end = 0.0, -float("inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def step_profile(events: list[dict], steps: int, top: int = 8, host_ok: bool = True) -> dict:
    """Per decode step: ops, busy ms, span ms, idle share, copies (a GPU stream's); and the
    `top` op kinds by time. host_ok: whether the host's events may stand for the ops."""
    found, source = op_events(events, host_ok)
    ops = [e for e in found if not COPY.match(e["name"])]
    if not ops:
        return {"status": f"no op events in the trace ({source})", "op_source": source}
    span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
    busy = busy_us(ops)
    kinds = collections.defaultdict(lambda: [0.0, 0])
    for e in ops:
        kind = kinds[re.sub(r"[._]\d+$", "", e["name"])]
        kind[0] += e["dur"]
        kind[1] += 1
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]
    return {"op_source": source, "steps": steps, "ops_per_step": len(ops) / steps,
            "busy_ms_per_step": busy / steps / 1e3, "span_ms_per_step": span / steps / 1e3,
            "idle_share": 1 - busy / span if span else 0.0,
            "copies_per_step": (len(found) - len(ops)) / steps,
            "top_ops": [{"op": k, "ms_per_step": us / steps / 1e3, "per_step": n / steps,
                         "share_of_busy": us / busy} for k, (us, n) in ranked]}


def decode_profile_rows(sizes: Sizes, repeats: int) -> list[dict]:
    """One generate() at batch 1 traced (after a compiling call and the median of `repeats`
    untraced ones): its step_profile."""
    name, cfg, _ = train_models(sizes)[1]
    base = {"model": name, "batch": 1, "prompt": sizes.prompt, "new_tokens": sizes.new_tokens,
            "graphs_traced": GRAPHS_TRACED in os.environ.get("XLA_FLAGS", "")}
    try:
        model, params, _ = bf16_model(cfg)
        run = greedy_call(model, params, 1, sizes)
        _, plain = median_seconds(run, repeats)  # untraced: a trace may change the launches
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                t0 = time.perf_counter()
                jax.block_until_ready(run())
                wall = time.perf_counter() - t0  # the call's, traced (not the trace's start)
            row = {**base, "untraced_wall_ms_per_step": plain / sizes.new_tokens * 1e3,
                   "traced_wall_ms_per_step": wall / sizes.new_tokens * 1e3,
                   **step_profile(trace_events(tmp), sizes.new_tokens,
                                  host_ok=jax.default_backend() == "cpu")}
    except Exception as e:
        row = {**base, "status": first_line(e)}
    print("decode_profile row:", json.dumps(row), flush=True)
    return [row]
