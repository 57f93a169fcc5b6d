"""The serving Engine behind asyncio: one thread owns the Engine (it is not thread-safe) and
takes submit/cancel commands from a queue, calls step() while there is work, and hands each
request's Events to that request's asyncio queue on the server's event loop.

    engine = AsyncEngine(Engine(model, params, slots=8), max_queue=64)
    engine.start(asyncio.get_running_loop())
    stream = await engine.submit(prompt_ids, RequestSettings(max_tokens=32))
    event = await stream.queue.get()     # Events until one with `finished`
    engine.cancel(stream)                # frees its slot and pages (idempotent)

At most slots + max_queue requests are held at once; one more is refused at once
(Overloaded: HTTP 429), never queued without bound.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import queue
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np

from jaxformer.serve.engine import Event


class Overloaded(Exception):
    """The server holds as many requests as it may (its slots and its waiting queue)."""


@dataclasses.dataclass(eq=False)
class Stream:
    """One request as the server holds it: its events arrive in `queue` (on the loop)."""
    queue: asyncio.Queue
    submitted: float                    # time.monotonic() when it arrived
    request_id: int | None = None       # the engine's id, set by the engine's thread
    done: bool = False                  # its last event was delivered
    last: float | None = None           # when its latest token was delivered
    ends_as: str = "cancelled"          # what a cancel of it counts as (cancel's reason)


class Metrics:
    """Counts and latencies of the requests served, kept on the event loop's thread."""

    WINDOW = 10.0  # seconds of tokens counted in tokens/s

    def __init__(self, samples: int = 10_000):
        self.finished = collections.Counter()          # finish reason -> requests
        self.ttft = collections.deque(maxlen=samples)   # seconds to the first token
        self.itl = collections.deque(maxlen=samples)    # seconds between tokens
        self.recent = collections.deque()               # (time, tokens delivered)
        self.tokens = 0
        self.refused = 0

    def token(self, stream: Stream, now: float) -> None:
        """A token of `stream` delivered at `now`."""
        (self.itl if stream.last is not None else self.ttft).append(
            now - (stream.last if stream.last is not None else stream.submitted))
        stream.last = now
        self.tokens += 1
        self.recent.append(now)
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the tokens older than WINDOW: `recent` holds one window at most."""
        while self.recent and self.recent[0] < now - self.WINDOW:
            self.recent.popleft()

    def tokens_per_second(self, now: float) -> float:
        self._forget(now)
        return len(self.recent) / self.WINDOW

    @staticmethod
    def percentiles(samples) -> dict[str, float | None]:
        """p50/p90/p99 of the samples, in milliseconds (None without samples)."""
        values = np.asarray(samples, np.float64) * 1e3
        return {f"p{q}": (float(np.percentile(values, q)) if values.size else None)
                for q in (50, 90, 99)}


class AsyncEngine:
    """An Engine driven by one thread of its own, for asyncio callers."""

    def __init__(self, engine, *, max_queue: int, slots: int | None = None):
        self.engine = engine
        self.slots = slots if slots is not None else engine.stats()["slots"]
        self.capacity = self.slots + max_queue
        self.metrics = Metrics()
        self.failure: str | None = None  # why a step failed (the server is then unhealthy)
        self.stats: dict[str, Any] = dict(engine.stats())  # replaced by the engine's thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._owned: dict[int, Stream] = {}   # the engine's thread's alone
        self._active = 0                      # the loop's alone
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> int:
        """Requests held: submitted and not yet ended."""
        return self._active

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout=30)
            self._thread = None

    async def submit(self, prompt: Sequence[int], settings) -> Stream:
        """Hand a request to the engine: its Stream, the engine's ValueError (bad input),
        or Overloaded when slots + max_queue requests are held already."""
        if self._active >= self.capacity:
            self.metrics.refused += 1
            raise Overloaded(f"the server holds {self._active} requests ({self.slots} slots "
                             f"+ a waiting queue of {self.capacity - self.slots}); retry later")
        stream = Stream(asyncio.Queue(), time.monotonic())
        self._active += 1
        future = concurrent.futures.Future()
        future.add_done_callback(lambda f: f.exception() is not None and
                                 self._loop.call_soon_threadsafe(self._release, stream))
        self._commands.put(("submit", stream, list(prompt), settings, future))
        try:  # shielded: the engine's thread submits it whatever becomes of this caller
            await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.cancel(stream)  # its end frees it
            raise
        return stream

    def cancel(self, stream: Stream, reason: str = "cancelled") -> None:
        """End a request early; its slot and pages are freed, its queue gets a "cancelled"
        end (unless it had ended already). reason: what /metrics counts it as ("stop": the
        server ended it at a stop string; "cancelled": its client went away)."""
        if not stream.done:
            stream.ends_as = reason
            self._commands.put(("cancel", stream))

    # --- the engine's thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            commands = [self._commands.get()] if not self.engine.has_work() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            batch = []  # (stream, event)
            for command in commands:
                if command[0] == "stop":
                    return
                try:
                    batch += self._obey(command)
                except Exception:  # the engine refused a cancel: the thread goes on
                    traceback.print_exc(file=sys.stderr)
            if self.engine.has_work():
                batch += self._step()
            self.stats = dict(self.engine.stats())
            if batch:
                self._loop.call_soon_threadsafe(self._deliver, batch)

    def _obey(self, command) -> list:
        """Run one submit or cancel command; the (stream, end) it makes."""
        if command[0] == "submit":
            _, stream, prompt, settings, future = command
            try:
                stream.request_id = self.engine.submit(prompt, settings)
            except Exception as e:  # the engine's one-line ValueError, for HTTP 400
                future.set_exception(e)
                return []
            self._owned[stream.request_id] = stream
            future.set_result(stream.request_id)
            return []
        stream = command[1]
        if self._owned.pop(stream.request_id, None) is None:
            return []  # ended already
        self.engine.cancel(stream.request_id)
        return [(stream, Event(stream.request_id, -1, 0.0, (), "cancelled"))]

    def _step(self) -> list:
        """One engine step's (stream, event) pairs, a stream dropped at its last event; on
        an engine failure, every request ended "error"."""
        try:
            events = list(self.engine.step())
        except Exception as e:  # its pool may be gone (donated): no step is trusted again
            traceback.print_exc(file=sys.stderr)
            self.failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]:.200}"
            events = [Event(i, -1, 0.0, (), "error") for i in self._owned]
            for i in self._owned:
                try:
                    self.engine.cancel(i)
                except Exception:  # the thread goes on, to end the requests
                    traceback.print_exc(file=sys.stderr)
        batch = []
        for e in events:
            stream = self._owned.get(e.request_id)
            if stream is not None:
                batch.append((stream, e))
                if e.finished is not None:
                    del self._owned[e.request_id]
        return batch

    def _deliver(self, batch: list) -> None:
        """On the loop: each event into its stream's queue; ends and latencies counted."""
        now = time.monotonic()
        for stream, e in batch:
            if stream.done:
                continue
            if e.token >= 0:
                self.metrics.token(stream, now)
            stream.queue.put_nowait(e)
            if e.finished is not None:
                self._release(stream)
                self.metrics.finished[stream.ends_as if e.finished == "cancelled"
                                      else e.finished] += 1

    def _release(self, stream: Stream) -> None:
        """On the loop: a request's place in the server given back (once)."""
        if not stream.done:
            stream.done = True
            self._active -= 1
