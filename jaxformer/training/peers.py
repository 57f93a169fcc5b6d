"""A lost process on a multi-process run: the survivors stop in one line, not a hang.

When one process of a run is killed (or its host goes), the others block in their next
collective until JAX's coordination service gives up on it (a 100 s heartbeat) and
aborts them with pages of C++ stack traces. Instead, a thread in every process beats a
key in JAX's distributed key-value store every heartbeat_s / 4 seconds; process 0 reads
them all, and when one has not changed for distributed.heartbeat_s it names that process
under LOST_KEY. Every survivor then prints one line (`lost_line`: the missing process,
the newest intact checkpoint step, what to run) and ends with EXIT_LOST; os._exit, since
a blocked collective cannot be unwound. Process 0 goes last: the coordination service
lives in it, and the others' JAX clients abort the moment it is gone.

A process that leaves training (done, or on its own error) says so in its key, and is
no longer watched. An error first waits for the watch (`linger`): with one device per
process a collective does not hang when a peer dies, it fails at once ("Gloo all-reduce
failed ... Connection reset by peer"), well before the peer's silence can be noticed;
leaving then would stop the watch, and the process would hang in JAX's shutdown barrier
until JAX's own heartbeat aborted it. The wait ends as soon as every peer has beaten
since the error (the error is this process's own), or when the watch names a lost one.

Process 0 itself lost is caught by the parent process that train.py runs a multi-process
training under (training/supervise.py): jaxlib's client aborts the others at once, before
this watch can speak. Gloo aborting a survivor (a peer killed in the middle of a
collective) is held there too, so that this watch still names the lost process. Either
way the checkpoints hold: a save in flight is still in orbax's temporary directory, no step.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import time

import jax

from jaxformer.training.checkpoint import newest_intact_step

EXIT_LOST = 3
PREFIX = "jaxformer/peers/"
LOST_KEY = "jaxformer/lost"
DONE = "done"


def lost_line(missing: int, count: int, heartbeat_s: float, checkpoints: pathlib.Path) -> str:
    """The one line a survivor prints: who is gone, and where to resume from."""
    step = newest_intact_step(checkpoints, contents=False)  # sizes only: stop in seconds
    where = (f"the newest intact checkpoint is step {step} in {checkpoints}" if step is not None
             else f"no checkpoint is saved yet in {checkpoints}")
    then = "resume from it" if step is not None else "start over"
    return (f"jaxformer: process {missing} of {count} is gone (no heartbeat for "
            f"{heartbeat_s:g} s); {where}; rerun the same command on every host to {then}")


class PeerWatch:
    """The heartbeat thread of one process (see the module's docstring). `client`: JAX's
    DistributedRuntimeClient (key_value_set / key_value_try_get / key_value_dir_get)."""

    def __init__(self, client, process: int, count: int, heartbeat_s: float,
                 checkpoints: pathlib.Path, *, clock=time.monotonic, sleep=time.sleep,
                 exit=os._exit):
        self.client, self.process, self.count = client, process, count
        self.heartbeat_s, self.checkpoints = heartbeat_s, pathlib.Path(checkpoints)
        self.clock, self.sleep, self.exit = clock, sleep, exit
        self.beats = 0
        self.seen: dict[int, tuple[str | None, float]] = {}  # peer: (last value, since)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="jaxformer-peers", daemon=True)

    def start(self):
        now = self.clock()  # a peer's silence counts from here until its first beat
        self.seen = {p: (None, now) for p in range(self.count) if p != self.process}
        self.thread.start()

    def stop(self):
        """This process leaves training: it says so, and stops beating and watching."""
        self.stopping.set()
        self.thread.join()
        with contextlib.suppress(Exception):  # the coordinator may be gone already
            self.client.key_value_set(PREFIX + str(self.process), DONE, allow_overwrite=True)

    def run(self):
        while not self.stopping.wait(self.heartbeat_s / 4):
            try:
                missing = self.beat()
            except Exception:  # the coordinator (process 0) cannot be reached
                missing = 0 if self.process != 0 else None
            if missing is not None and not self.stopping.is_set():
                self.leave(missing)

    def beat(self) -> int | None:
        """Publish this process's beat; the lost process, if one is found, else None."""
        self.beats += 1
        self.client.key_value_set(PREFIX + str(self.process), str(self.beats),
                                  allow_overwrite=True)
        if self.process != 0:
            with contextlib.suppress(Exception):  # not set: nobody is lost
                return int(self.client.key_value_try_get(LOST_KEY))
            return None
        values = dict(self.client.key_value_dir_get(PREFIX))
        now = self.clock()
        for peer, (last, since) in list(self.seen.items()):
            value = values.get(PREFIX + str(peer))
            if value == DONE:
                del self.seen[peer]
            elif value != last:
                self.seen[peer] = (value, now)
            elif now - since > self.heartbeat_s:
                self.client.key_value_set(LOST_KEY, str(peer), allow_overwrite=True)
                return peer
        return None

    def beats_of_peers(self) -> dict[str, str] | None:
        """Every peer's key as it is now; None when the coordinator cannot be reached."""
        try:
            return dict(self.client.key_value_dir_get(PREFIX))
        except Exception:
            return None

    def linger(self):
        """On this process's own error, before it leaves: return once every peer still
        training has beaten since (none is lost), or after 2 x heartbeat_s; meanwhile the
        watch thread ends the process if it finds a lost peer (see the module's docstring)."""
        before, deadline = self.beats_of_peers(), self.clock() + 2 * self.heartbeat_s
        peers = [PREFIX + str(p) for p in range(self.count) if p != self.process]
        while self.clock() < deadline:
            self.sleep(self.heartbeat_s / 8)
            now = self.beats_of_peers()
            if before is not None and now is not None and all(
                    now.get(k) == DONE or now.get(k) != before.get(k) for k in peers):
                return

    def leave(self, missing: int):
        """Print the line and end this process; process 0 first gives the others a few
        beats to read LOST_KEY (they cannot once it, and the coordinator, are gone)."""
        if self.process == 0 and self.count > 2:
            time.sleep(self.heartbeat_s / 2)
        line = lost_line(missing, self.count, self.heartbeat_s, self.checkpoints)
        os.write(2, (line + "\n").encode())
        self.exit(EXIT_LOST)


@contextlib.contextmanager
def watch_peers(run_dir, heartbeat_s: float):
    """Watch the other processes while the block runs (nothing on one process)."""
    from jax._src.distributed import global_state  # JAX's client: no public handle yet
    if jax.process_count() == 1 or global_state.client is None:
        yield None
        return
    watch = PeerWatch(global_state.client, jax.process_index(), jax.process_count(),
                      heartbeat_s, pathlib.Path(run_dir).absolute() / "checkpoints")
    watch.start()
    try:
        yield watch
    except Exception:
        watch.linger()  # a collective failed: perhaps because a peer is gone
        raise
    finally:
        watch.stop()
