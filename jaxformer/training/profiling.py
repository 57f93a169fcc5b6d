"""train.profile=START:STOP: a jax.profiler trace (XProf / TensorBoard's profile plugin) of
the train steps from the state's step START to STOP (the steps logged as START + 1 .. STOP;
1:3 skips the first step, which holds the compile, and traces the next two), written
under RUN/profile/plugins/profile/<time>/<host>.xplane.pb. Open it with
`tensorboard --logdir RUN/profile` (the profile tab; pip install tensorboard-plugin-profile)
or `xprof --logdir RUN/profile`.
"""

from __future__ import annotations

import pathlib

import jax

from jaxformer.core.validation import ConfigError

FIX = "must be START:STOP, two step counts with 0 <= START < STOP (e.g. 1:3)"


def traced_steps(value, steps: int | None = None) -> tuple[int, int] | None:
    """train.profile's (START, STOP), or None when unset; a bad value, or one that starts
    at or after train.steps (`steps`: no step of it would run), refused in one line."""
    if value is None or value == "":
        return None
    parts = str(value).split(":")
    try:
        start, stop = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        start = stop = None
    if start is None or not 0 <= start < stop:
        raise ConfigError(f"train.profile={value!r} {FIX}; in YAML, quote it ('1:3')")
    if steps is not None and start >= steps:
        raise ConfigError(f"train.profile={value} starts at step {start}, not before "
                          f"train.steps={steps}: no step of it would run; choose START below "
                          f"{steps}")
    return start, stop


class StepTrace:
    """A context manager the loop calls with each step's index before dispatching it
    (at(step, state)): the trace starts at START and stops at STOP once the steps before
    have finished (the state is waited for), or when the run leaves the context first."""

    def __init__(self, value, run_dir: pathlib.Path, *, start: int = 0, log=print):
        """start: the run's first step (a resumed run's); a window it is past is said."""
        self.steps, self.directory = traced_steps(value), pathlib.Path(run_dir) / "profile"
        self.on = False
        if self.steps is not None and start >= self.steps[1]:
            log(f"train.profile={value}: this run starts at step {start}, past it; nothing "
                f"is traced (choose a window after {start})")

    def __enter__(self):
        return self

    def at(self, step: int, state) -> None:
        if self.steps is None:
            return
        start, stop = self.steps
        if not self.on and start <= step < stop:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.block_until_ready(state)  # the steps before START stay out of the trace
            jax.profiler.start_trace(str(self.directory))
            self.on = True
        elif self.on and step >= stop:
            self.stop(state)

    def stop(self, state=None) -> None:
        if self.on:
            jax.block_until_ready(state)  # the traced steps' device work is in the trace
            jax.profiler.stop_trace()
            self.on = False

    def __exit__(self, *exc):
        self.stop()
