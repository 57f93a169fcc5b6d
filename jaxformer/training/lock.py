"""One training run per run directory: an advisory lock on RUN_DIR/.lock, which the OS
drops when the process that holds it ends, however it ends; and the directory checked to
be one (not a file) as it is made."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import socket

from jaxformer.core.validation import ConfigError


def make_run_dir(run_dir: pathlib.Path) -> None:
    """train.run_dir made (with its parents) if it is not there; a ConfigError in one line
    where it is a file, or inside one."""
    file = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
    if file == run_dir:
        raise ConfigError(f"train.run_dir={run_dir} is a file; choose a directory")
    if file is not None:
        raise ConfigError(f"train.run_dir={run_dir} is inside {file}, a file; choose a directory")
    run_dir.mkdir(parents=True, exist_ok=True)


class RunDirInUse(RuntimeError):
    """Another live process is training in this run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: pathlib.Path, *, log=print):
    """Hold RUN_DIR/.lock while the block runs. The file names its holder; it is emptied
    at a clean exit, so a name found in an unlocked file is a process that died."""
    f = open(pathlib.Path(run_dir) / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirInUse(f"{run_dir} is in use by {holder}; wait for that run to end (or "
                          "stop it), or train in another train.run_dir") from None
    f.seek(0)
    if previous := f.read().strip():
        log(f"{run_dir}: taking over the lock of {previous}, which is no longer running")
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    try:
        yield
    finally:
        f.truncate(0)
        f.close()
