"""A multi-process run trains in a child process, so that a lost coordinator ends it in
one line too (training/peers.py catches every other lost process).

When process 0 dies, the coordination service dies with it, and jaxlib's client in every
other process aborts that process at once (SIGABRT, "Terminating process because the JAX
distributed service detected fatal errors", then a C++ stack trace). jax 0.10 offers no
usable hook for it: `missed_heartbeat_callback` is not reachable through
`jax.distributed.initialize`, and it fails with std::bad_cast when set on a client made by
hand. So `train.py` runs the training in a child and relays the child's stderr here,
each chunk HOLD_S late. When the child ends in JAX's abort, or with peers.py's line, the
lines still held are its death rattle: they go to RUN_DIR/lost-process-<i>.log, and the
last line printed is the one that names the lost process and the newest intact checkpoint
(exit 3). Anything else the child prints reaches stderr as it would have, a second late.

A peer killed in the middle of a collective can also make gloo abort a survivor at once:
XLA's gloo collectives carry no tags, so the next collective on a broken connection reads
the dead peer's last message as its own ("op.preamble.length <= op.nbytes ... Is there a
distributed collective mismatch in your code?"), and gloo's thread calls abort(). That
says nothing of which process is gone, so an abort in the child stops only the thread
that called it (`hold_aborts`: faulthandler prints ABORTED and the Python stacks, then the
thread sleeps in pause()), and the rest of the child, its peer watch included, goes on.
From ABORTED on the parent holds everything the child prints, and gives the watch
2 x heartbeat_s to name the lost process and exit 3; JAX's own abort already names it, so
that one is ended at once. A child still there then is killed, and its abort relayed whole.

The child dies with its parent (PR_SET_PDEATHSIG on Linux): a host that loses this
process loses its training too. SIGTERM and SIGHUP are passed on to the child; SIGINT from
a terminal reaches the child by itself (the same process group), so the parent ignores it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time

from jaxformer.training.peers import EXIT_LOST, lost_line

CHILD = "JAXFORMER_SUPERVISOR"  # in the child's environment: its parent's pid
HOLD_S = 1.0
ABORT = b"Terminating process because the JAX distributed service detected fatal errors"
ABORTED = b"Fatal Python error: Aborted"  # faulthandler's first words on SIGABRT
LINE = re.compile(rb"jaxformer: process \d+ of \d+ is gone [^\n]*\n?$")
NAMED = (re.compile(rb"Task (\d+) heartbeat timeout"),  # the service's words for a peer
         re.compile(rb"stopped sending heartbeats\):\s*(\d+)"))


def in_child() -> bool:
    """Whether this process is a supervised child: then it dies with its parent."""
    parent = os.environ.get(CHILD)
    if parent is None:
        return False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        hold_aborts(libc)
    if os.getppid() != int(parent):  # the parent went before the line above
        os._exit(EXIT_LOST)
    return True


def hold_aborts(libc: ctypes.CDLL):
    """abort() in this process stops only its calling thread (see the module's docstring):
    SIGABRT's handler is libc's pause(), after faulthandler's dump, which calls it."""
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    faulthandler.disable()  # enabled again after: it chains to the handler it finds
    libc.signal(signal.SIGABRT, ctypes.cast(libc.pause, ctypes.c_void_p))
    faulthandler.enable()


def lost_process(held: bytes, process: int | None) -> int | None:
    """Which process JAX's abort is about: the task its message names, else the
    coordinator (process 0) when this process is another one; None when unknown."""
    for pattern in NAMED:
        if found := pattern.search(held):
            return int(found[1])
    return 0 if process != 0 else None


def relay(source: int, held: list, release: bool = True) -> bool:
    """Move what the child wrote to `source` into `held` [(time, bytes)], and (`release`)
    write what has been held HOLD_S to this process's stderr; False once the child closed
    it."""
    ready, _, _ = select.select([source], [], [], HOLD_S / 4)
    open_ = True
    if ready:
        chunk = os.read(source, 1 << 16)
        open_ = bool(chunk)
        if chunk:
            held.append((time.monotonic(), chunk))
    while release and held and held[0][0] <= time.monotonic() - HOLD_S:
        os.write(2, held.pop(0)[1])
    return open_


def verdict(rc: int, held: bytes, process: int | None, count: int, heartbeat_s: float,
            run_dir: pathlib.Path) -> tuple[bytes, int]:
    """(what to print of the held bytes, the exit status) once the child has ended with
    `rc`: its own lost line, a line for JAX's abort, or everything held and its status."""
    if rc == EXIT_LOST and (line := LINE.search(held)):
        return line[0].rstrip(b"\n") + b"\n", EXIT_LOST
    missing = lost_process(held, process) if ABORT in held else None
    if missing is None:
        return held, rc if rc >= 0 else 128 - rc
    line = lost_line(missing, count, heartbeat_s, run_dir.absolute() / "checkpoints")
    return (line + "\n").encode(), EXIT_LOST


def supervise(argv: list[str], run_dir, process: int | None, count: int,
              heartbeat_s: float) -> int:
    """Run `argv` (this training's own command) as a child and relay it; its exit status."""
    env = dict(os.environ, **{CHILD: str(os.getpid())})
    child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    held: list = []
    rc = watch_child(child, held, heartbeat_s)
    rest = b"".join(chunk for _, chunk in held)
    out, status = verdict(rc, rest, process, count, heartbeat_s, pathlib.Path(run_dir))
    if status == EXIT_LOST and out != rest:
        log = pathlib.Path(run_dir) / f"lost-process-{process if process is not None else 0}.log"
        log.write_bytes(rest)
    os.write(2, out)
    return status


def watch_child(child: subprocess.Popen, held: list, heartbeat_s: float) -> int:
    """Relay the child's stderr into `held` until it ends; its exit status, SIGABRT's when
    it was killed here, an abort held (see the module's docstring)."""
    deadline, killed = None, False
    while relay(child.stderr.fileno(), held, release=deadline is None):
        if deadline is None and ABORTED in (now := b"".join(c for _, c in held)):
            deadline = time.monotonic() + (0 if ABORT in now else 2 * heartbeat_s)
        if deadline is not None and time.monotonic() > deadline and not killed:
            child.kill()  # and read on: the pipe closes with it
            killed = True
    rc = child.wait()
    return -signal.SIGABRT if killed and rc == -signal.SIGKILL else rc


def launch_shape(d) -> tuple[int | None, int]:
    """(this process's index or None, the number of processes) of a multi-process run, as
    the settings (`distributed`) or the launcher's environment say, before JAX is up."""
    env = os.environ
    count = d.num_processes or int(env.get("SLURM_NTASKS") or env.get("OMPI_COMM_WORLD_SIZE")
                                   or len(env.get("TPU_WORKER_HOSTNAMES", "").split(",")))
    ranks = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TPU_WORKER_ID")
    process = d.process_id if d.process_id is not None else \
        next((int(env[k]) for k in ranks if k in env), None)
    return process, count


def supervised(cfg) -> int | None:
    """Run this multi-process training under a supervising parent (see the module's
    docstring) and return its exit status; None when this process should train itself:
    one process, or the supervised child."""
    from jaxformer.core.sharding import cluster_detected
    d = cfg.distributed
    if in_child() or (d.coordinator_address is None and not cluster_detected()):
        return None
    process, count = launch_shape(d)
    return supervise([sys.executable, *sys.orig_argv[1:]], cfg.train.run_dir, process, count,
                     d.heartbeat_s)
