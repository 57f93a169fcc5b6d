"""The events of a jax.profiler trace written with create_perfetto_trace=True (its
perfetto_trace.json.gz, Chrome's trace-event JSON), as bench/op_profile.py and bench/gpu.py's
decode_profile read them."""

from __future__ import annotations

import gzip
import json
import os


def trace_events(trace_dir: str) -> list[dict]:
    """Every event of the one perfetto trace under trace_dir."""
    path = next(os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs
                if f.endswith("perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)
    return events["traceEvents"] if isinstance(events, dict) else events
