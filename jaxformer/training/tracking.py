"""Weights & Biases tracking (train.wandb=PROJECT): every record of metrics.jsonl, logged
at its step as W&B's step, and the resolved run config as the W&B run's config. The W&B
files go under run_dir/wandb; the W&B run id is kept in run_dir/wandb_id, so a resumed run
(train.resume=auto) continues the same W&B run. Process 0 alone logs.

The loop's side: check (before any work), start -> log(record) ... -> finish."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

from jaxformer.core.validation import ConfigError

INSTALL = "pip install 'jaxformer[wandb]'"
ID_FILE = "wandb_id"


def check(train_cfg, lead: bool = True) -> None:
    """With train.wandb set, the lead process needs the wandb package: one line if not."""
    if train_cfg.wandb and lead and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb={train_cfg.wandb} needs the wandb package: {INSTALL}")


class Tracker:
    """One W&B run: log(record) for each metrics.jsonl record, finish() once at the end."""

    def __init__(self, run):
        self.run = run
        # a resumed online run already holds the steps it logged before the resume; the
        # resumed run may log some again (those after its checkpoint): W&B refuses them
        self.first_step = run.step
        # the exception the caller was handling when the run started (train() called in
        # an except block), not one of the run's own
        self.outer = sys.exc_info()[1]

    def log(self, record: dict) -> None:
        step = int(record["step"])
        if step < self.first_step:
            return
        flat = {}
        for key, value in record.items():  # a sweep's losses: one plottable key each
            if isinstance(value, (list, tuple)):
                flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
            else:
                flat[key] = value
        self.run.log(flat, step=step)

    def finish(self) -> None:
        """Marks the W&B run failed when called while an exception raised since the run
        started is propagating (an ExitStack callback sees it), finished otherwise."""
        failing = sys.exc_info()[1]
        self.run.finish(exit_code=1 if failing is not None and failing is not self.outer else 0)


def start(cfg, run_dir, lead: bool = True) -> Tracker | None:
    """The W&B run of `cfg` (a RunConfig) in run_dir, or None (train.wandb unset, or not
    the lead process)."""
    t = cfg.train
    if not t.wandb or not lead:
        return None
    check(t)
    if t.wandb_mode == "offline":  # else wandb-core looks up its error-report server
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    import wandb

    run_dir = pathlib.Path(run_dir)
    id_file = run_dir / ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None
    try:
        run = wandb.init(project=t.wandb, id=run_id, resume="allow" if run_id else None,
                         dir=str(run_dir), mode=t.wandb_mode, name=run_dir.resolve().name,
                         config=cfg.to_dict(),
                         settings=wandb.Settings(silent=True, console="off"))  # no prints
    except wandb.errors.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"train.wandb={t.wandb} (train.wandb_mode={t.wandb_mode}): W&B "
                          f"could not start: {first.rstrip('.')}; or run with "
                          "train.wandb_mode=offline") from e
    if run_id is None:
        id_file.write_text(run.id + "\n")
    return Tracker(run)
