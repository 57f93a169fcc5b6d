"""A lost process: of two processes on localhost, one is SIGKILLed mid-run (in a step or
in a save; two devices per process or one; the coordinator too); the other stops within
30 s with one line naming it and the newest intact checkpoint step (exit 3), and the same
command rerun on both resumes there with the uninterrupted run's losses. And the watch's
and the supervisor's own logic, with a fake key-value store and clock, and with a child
process that aborts (as gloo does when a peer dies mid-collective, which is rare here)."""

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, supervise
from jaxformer.training.checkpoint import damage, write_manifest
from jaxformer.training.metrics import read_metrics
from jaxformer.training.peers import DONE, EXIT_LOST, LOST_KEY, PREFIX, PeerWatch, lost_line
from tests.conftest import REPO, xla_flags

pytestmark = pytest.mark.heavy  # run first: tests/conftest.py

STEPS, EVERY = 16, 2
LINE = re.compile(r"jaxformer: process (\d) of 2 is gone \(no heartbeat for 3 s\); the newest "
                  r"intact checkpoint is step (\d+) in (\S+)/checkpoints; rerun the same "
                  r"command on every host to resume from it")


def _free_port(rng):
    """A free port below the kernel's ephemeral range: a client that retries its connect
    before process 0 listens can never be handed it as its own port (a TCP self-connect,
    which then makes process 0's bind fail)."""
    import socket
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in rng.permutation(np.arange(20000, min(low, 32768))):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("localhost", int(port)))
            return int(port)
    raise RuntimeError("no free port")


def launch(tmp_path, run, port, seed, devices=2):
    """Both processes of a 2 x `devices`-device run, as every host would start it. Every
    other save is also a new best's (an evaluation every 2 x EVERY steps): the two saves of
    a step in flight at once, whose barriers collided before they were named apart."""
    common = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
              "train.seq_len=32", "train.batch_size=4", f"train.steps={STEPS}",
              "train.log_every=1", f"train.eval_every={2 * EVERY}", "train.eval_batches=1",
              "train.sample_tokens=0", "train.progress=false", f"train.seed={seed}",
              "optim.warmup_steps=2", f"checkpoint.every={EVERY}", "checkpoint.keep=3",
              f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'cache'}",
              f"train.run_dir={run}", f"distributed.coordinator_address=localhost:{port}",
              "distributed.num_processes=2", "distributed.heartbeat_s=3"]
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags(devices=devices))
    return [subprocess.Popen([sys.executable, "train.py", *common, f"distributed.process_id={i}"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in range(2)]


def finish(procs, timeout):
    """[(process, stdout, stderr)] once both have ended; the test fails, with their
    stderr, if either still runs after `timeout` seconds (then both are killed)."""
    deadline, outs, late = time.time() + timeout, [], []
    for i, p in enumerate(procs):
        try:
            outs.append((p, *p.communicate(timeout=max(deadline - time.time(), 0.1))))
        except subprocess.TimeoutExpired:
            late.append(i)
            p.kill()
            outs.append((p, *p.communicate()))
    if late:
        for p in procs:
            p.kill()
        pytest.fail(f"process(es) {late} still ran after {timeout} s; stderr tails: "
                    + " | ".join(err[-1500:] for _, _, err in outs))
    return outs


def logged_step(run):
    try:
        return max((r["step"] for r in read_metrics(run) if "loss" in r), default=0)
    except (FileNotFoundError, ValueError):  # not there yet, or a line half-written
        return 0


def saving(run) -> bool:
    """Whether a checkpoint save is in flight (orbax writes it in a temporary directory)."""
    with contextlib.suppress(FileNotFoundError):
        return any("tmp" in p.name for p in (run / "checkpoints").iterdir())
    return False


def kill_one(tmp_path, rng, *, devices, victim, during):
    """Start a 2 x `devices`-device run, SIGKILL process `victim` once step 3 x EVERY + 1
    is logged ("step") or at the first save in flight after it ("save"), and check the
    survivor: within 30 s, exit 3 and one last line naming the victim and the newest
    intact step, no stack trace. Returns (seed, run dir, that step)."""
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x"]
    (tmp_path / "corpus.txt").write_text(
        "\n".join(" ".join(rng.choice(words, size=6)) for _ in range(600)))
    seed, run = int(rng.integers(1000)), tmp_path / "run"
    procs = launch(tmp_path, run, _free_port(rng), seed, devices)
    deadline = time.time() + 240
    while logged_step(run) < 3 * EVERY + 1 and time.time() < deadline \
            and procs[0].poll() is None:
        time.sleep(0.05)
    while during == "save" and not saving(run) and time.time() < deadline:
        time.sleep(0.001)
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    outs = finish(procs, timeout=30)
    (gone, _, _), (survivor, _, err) = outs[victim], outs[1 - victim]
    assert gone.returncode == -signal.SIGKILL
    assert survivor.returncode == EXIT_LOST, err[-3000:]
    assert time.time() - killed_at < 30
    found = LINE.fullmatch(err.strip().splitlines()[-1])  # the last line, and C++'s
    assert found, err[-3000:]                               # stack traces nowhere
    assert "stack trace" not in err and "Traceback" not in err, err[-3000:]
    missing, step, where = int(found[1]), int(found[2]), found[3]
    assert missing == victim and pathlib.Path(where) == run
    # the step named is the newest whole one: intact, and every newer directory not a step
    assert step % EVERY == 0 and step < STEPS and damage(run / "checkpoints" / str(step)) is None
    newer = [p for p in (run / "checkpoints").iterdir()
             if p.name.isdigit() and int(p.name) > step]
    assert all(damage(p) is not None for p in newer), newer
    return seed, run, step


def test_killed_process_stops_the_other_in_one_line_and_the_rerun_resumes(tmp_path, rng):
    seed, run, step = kill_one(tmp_path, rng, devices=2, victim=1, during="step")
    before = len(read_metrics(run))  # the killed run's records; the rerun's follow
    # the rerun and an uninterrupted run of the same seed, side by side (each waits on its
    # own coordinator and collectives at times: together they fill those waits)
    rerun = launch(tmp_path, run, _free_port(rng), seed)
    straight = launch(tmp_path, tmp_path / "straight", _free_port(rng), seed)
    (r0, out0, e0), (r1, _, e1) = finish(rerun, timeout=300)
    (s0, _, f0), (s1, _, f1) = finish(straight, timeout=300)
    assert r0.returncode == 0 and r1.returncode == 0, (e0[-3000:], e1[-3000:])
    assert f"resumed from {run}/checkpoints/{step}" in out0
    assert s0.returncode == 0 and s1.returncode == 0, (f0[-3000:], f1[-3000:])
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight") if "loss" in r}
    logged = [r for r in read_metrics(run) if "loss" in r]  # the killed run's, then the rerun's
    assert sorted(want) == list(range(1, STEPS + 1))
    assert [r["step"] for r in read_metrics(run)[before:] if "loss" in r] == \
        list(range(step + 1, STEPS + 1))
    assert {r["step"] for r in logged} == set(want)
    for r in logged:  # exactly: the same programs on the same devices
        assert r["loss"] == want[r["step"]], (r, want[r["step"]])


@pytest.mark.parametrize("devices, victim, during", [(1, 1, "save"), (1, 0, "step")],
                         ids=["one-device-each-killed-in-a-save", "the-coordinator-killed"])
def test_a_lost_process_is_named_in_every_layout(tmp_path, rng, devices, victim, during):
    """With one device per process a collective fails at once when a peer dies (it does
    not hang), and process 0's death aborts the others inside jaxlib: both still end in
    the one line."""
    kill_one(tmp_path, rng, devices=devices, victim=victim, during=during)


# ---- the watch's logic, without processes ------------------------------------------------

class FakeStore:
    """The calls PeerWatch makes on JAX's client, over a dict."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise KeyError(key)
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_watch_names_the_silent_peer_and_not_the_finished_one(tmp_path, rng):
    count, heartbeat = 4, 4.0 * int(rng.integers(1, 6))  # beats of whole seconds: exact sums
    store, clock, exits = FakeStore(), Clock(), []
    watches = [PeerWatch(store, p, count, heartbeat, tmp_path, clock=clock, exit=exits.append)
               for p in range(count)]
    for w in watches:
        w.seen = {p: (None, clock()) for p in range(count) if p != w.process}
    silent = int(rng.integers(1, count))
    done = next(p for p in range(1, count) if p != silent)
    for _ in range(3):  # all beat
        clock.now += heartbeat / 4
        assert [w.beat() for w in watches] == [None] * count
    store.kv[PREFIX + str(done)] = DONE  # finished: no more beats, and not missed
    clock.now += heartbeat / 4
    assert [w.beat() for w in watches if w.process != done] == [None] * (count - 1)
    alive = [w for w in watches if w.process not in (silent, done)]
    found = []
    while not found:
        clock.now += heartbeat / 4
        found = [m for m in (w.beat() for w in alive) if m is not None]
        assert clock.now < 200
    # from the silent peer's last beat: over `heartbeat`, and found within two more beats
    # (process 0 reads each beat on its own next one)
    silent_for = clock.now - (100.0 + 4 * heartbeat / 4)
    assert heartbeat < silent_for <= heartbeat + 2 * heartbeat / 4 + 1e-9
    assert found[0] == silent and store.kv[LOST_KEY] == str(silent)
    assert [w.beat() for w in alive[1:]] == [silent] * (len(alive) - 1)  # the others read it


def test_the_line_names_the_newest_whole_step(tmp_path, capfd):
    ckpt = tmp_path / "checkpoints"
    for step in (4, 6, 8):
        (ckpt / str(step) / "state").mkdir(parents=True)
        (ckpt / str(step) / "state" / "data").write_bytes(os.urandom(64))
    write_manifest(ckpt / "4")
    write_manifest(ckpt / "6")
    (ckpt / "6" / "state" / "data").write_bytes(os.urandom(10))  # truncated: damaged
    (ckpt / "10.orbax-checkpoint-tmp-123").mkdir()  # a save in flight; 8 is not sealed
    exits = []
    watch = PeerWatch(FakeStore(), 0, 2, 3.0, ckpt, exit=exits.append)
    watch.leave(1)
    line = capfd.readouterr().err
    assert exits == [EXIT_LOST]
    assert line == (f"jaxformer: process 1 of 2 is gone (no heartbeat for 3 s); the newest "
                    f"intact checkpoint is step 4 in {ckpt}; rerun the same command on every "
                    "host to resume from it\n")


def test_heartbeat_setting_is_checked():
    with pytest.raises(ConfigError, match=r"^distributed.heartbeat_s=0.5 must be >= 1$"):
        load_config(None, ["distributed.heartbeat_s=0.5"])


def test_an_error_waits_for_the_watch_only_while_a_peer_is_silent(tmp_path, rng):
    """linger: returns once every peer still training has beaten since the error (the
    error is this process's own), and stays while one is silent, for the watch to name it."""
    count, heartbeat = 3, float(rng.integers(2, 10))
    store, clock = FakeStore(), Clock()
    watch = PeerWatch(store, 1, count, heartbeat, tmp_path, clock=clock, exit=None)
    store.kv.update({PREFIX + "0": "7", PREFIX + "2": "3"})
    beating = [0, 2]

    def sleep(seconds):  # the peers in `beating` beat as time passes
        clock.now += seconds
        for p in beating:
            store.kv[PREFIX + str(p)] = str(int(store.kv[PREFIX + str(p)]) + 1)

    watch.sleep = sleep
    start = clock.now
    watch.linger()
    assert clock.now - start <= heartbeat / 8 + 1e-9  # one beat of each: at once
    beating[:] = [0]  # process 2 silent: the whole wait, 2 x heartbeat
    start = clock.now
    watch.linger()
    assert 2 * heartbeat <= clock.now - start <= 2 * heartbeat + heartbeat / 8 + 1e-9
    store.kv[PREFIX + "2"] = DONE  # left training: not waited for
    start = clock.now
    watch.linger()
    assert clock.now - start <= heartbeat / 8 + 1e-9


NOISE = (b"W1128 21:40:03.158860    7815 preemption_sync_manager.cc:147] Failed to retrieve "
         b"preemption notice from coordination service: UNAVAILABLE\n")


@pytest.mark.parametrize("process", [1, 2])
def test_jax_abort_becomes_the_line_naming_the_lost_process(tmp_path, process):
    """supervise.verdict on what a child left held when it ended."""
    def verdict(rc, held):
        return supervise.verdict(rc, held, process, 3, 4.0, tmp_path)

    abort = NOISE + b"F1128 client.h:80] " + supervise.ABORT + b". absl::Status: UNAVAILABLE: " \
        b"Failed to send RPC to coordination service. Either the leader task died\n" \
        b"*** Check failure stack trace: ***\n    @ 0x7f58 absl::LogMessage::SendToLog()\n"
    line = lost_line(0, 3, 4.0, tmp_path.absolute() / "checkpoints")
    assert verdict(-signal.SIGABRT, abort) == ((line + "\n").encode(), EXIT_LOST)
    other = 2 if process == 1 else 1  # the service names a task that stopped beating
    named = abort.replace(b"Either the leader task died",
                          b"Task %d heartbeat timeout" % other)
    line = lost_line(other, 3, 4.0, tmp_path.absolute() / "checkpoints")
    assert verdict(-signal.SIGABRT, named) == ((line + "\n").encode(), EXIT_LOST)
    own = NOISE + (line + "\n").encode()  # the child's own line (peers.py) after the noise
    assert verdict(EXIT_LOST, own) == ((line + "\n").encode(), EXIT_LOST)
    crash = b"Traceback (most recent call last):\nValueError: bad\n"  # not a lost process
    assert verdict(1, crash) == (crash, 1)
    assert verdict(-signal.SIGKILL, NOISE) == (NOISE, 128 + signal.SIGKILL)
    assert verdict(-signal.SIGABRT, NOISE) == (NOISE, 128 + signal.SIGABRT)


# ---- an abort in the supervised child: held for the watch, not the end of it ------------

PARENT = ("import sys; from jaxformer.training.supervise import supervise; sys.exit(supervise("
          "[sys.executable, '-c', sys.argv[1]], sys.argv[2], int(sys.argv[3]), 2, "
          "float(sys.argv[4])))")
CHILD = """
import ctypes, os, pathlib, sys, threading, time
from jaxformer.training.peers import EXIT_LOST, lost_line
from jaxformer.training.supervise import in_child
assert in_child()
os.write(2, MESSAGE + b"\\n")
os.write(2, b"aborted at %r\\n" % time.time())
threading.Thread(target=ctypes.CDLL(None).abort).start()  # as gloo's or jaxlib's thread does
time.sleep(1.5)  # the watch names the lost peer, or never does
if NAMES:
    os.write(2, (lost_line(1, 2, HEARTBEAT, pathlib.Path.cwd() / "checkpoints") + "\\n").encode())
    os._exit(EXIT_LOST)
time.sleep(60)
"""
GLOO = (b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
        b"[enforce fail at gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. "
        b"16 vs 4. Received data size doesn't match expected size.")


@pytest.mark.parametrize("case", ["gloo-then-the-watch", "gloo-alone", "jax"])
def test_an_abort_in_the_child_waits_for_the_watch(tmp_path, case):
    """The child aborts in a thread (gloo's collective after a peer died, or jaxlib's client
    when the coordinator went). Gloo's abort names no process: the child lives on, and its
    watch's line is the parent's last (the abort goes to the log); when no line comes, the
    child is killed after 2 x heartbeat_s and its abort relayed. JAX's names process 0 (the
    coordinator): the parent ends the child and prints that line at once."""
    message = supervise.ABORT if case == "jax" else GLOO
    # the child's line comes 1.5 s after its abort, well within 2 x heartbeat_s; "jax" is
    # not waited for
    heartbeat = {"gloo-then-the-watch": 3.0, "gloo-alone": 1.0, "jax": 10.0}[case]
    names = case == "gloo-then-the-watch"  # the child's watch names the lost process 1
    script = CHILD.replace("MESSAGE", repr(message)).replace("NAMES", str(names)) \
        .replace("HEARTBEAT", repr(heartbeat))
    process = 1 if case == "jax" else 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", PARENT, script, str(tmp_path), str(process),
                           str(heartbeat)], cwd=tmp_path, env=env, capture_output=True,
                          timeout=120)
    ended, err = time.time(), done.stderr.decode()
    log_path = tmp_path / f"lost-process-{process}.log"  # the abort, kept when a line ends it
    log = log_path.read_bytes() if log_path.exists() else b""
    waited = ended - float(re.search(rb"aborted at ([\d.]+)", done.stderr + log)[1])
    if case == "gloo-alone":  # killed after the watch's time, and the whole abort relayed
        assert done.returncode == 128 + signal.SIGABRT, err
        assert supervise.ABORTED.decode() in err and "16 vs 4" in err
        assert 2 * heartbeat <= waited < 2 * heartbeat + 30, waited
        return
    assert done.returncode == EXIT_LOST, err
    missing = 0 if case == "jax" else 1
    assert err == lost_line(missing, 2, heartbeat, tmp_path / "checkpoints") + "\n"
    assert message in log and supervise.ABORTED in log
    if case == "jax":
        assert waited < heartbeat, waited  # not 2 x heartbeat_s
