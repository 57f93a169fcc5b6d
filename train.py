"""Train a model: python train.py [configs/NAME.yaml] [section.key=value ...]
(`--config configs/NAME.yaml` names the file too)

    python train.py                                   # configs/tiny.yaml
    python train.py configs/gpt2_small.yaml train.steps=2000 optim.lr=6e-4
    python train.py train.init_from=HF_DIR model.lora.rank=8    # no default config file
"""

from __future__ import annotations

import faulthandler
import sys

DEFAULT_CONFIG = "configs/tiny.yaml"


USAGE = "usage: python train.py [configs/NAME.yaml] [section.key=value ...]"


def usage_error(what: str):
    print(f"error: {what}; {USAGE}", file=sys.stderr)
    raise SystemExit(2)


def arguments(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the config file, the overrides) of the command line: the file first, or anywhere as
    `--config PATH` / `--config=PATH`. A stray argument or another option: SystemExit(2)
    after one line naming it."""
    config, args, rest = None, [], iter(argv)
    for a in rest:
        if a == "--config" or a.startswith("--config="):
            config = a.partition("=")[2] if "=" in a else next(rest, "")
            if not config or config.startswith("-") or "=" in config:
                usage_error(f"--config needs a file, got {config!r}")
        else:
            args.append(a)
    if config is None and args and "=" not in args[0] and not args[0].startswith("-"):
        config = args.pop(0)
    options = [a for a in args if a.startswith("-")]
    if options:
        usage_error(f"unknown option(s) {' '.join(options)} (settings are section.key=value)")
    if any("=" not in a for a in args):
        usage_error(f"unexpected argument(s) {' '.join(a for a in args if '=' not in a)}")
    # fine-tuning (train.init_from) takes its model from the weights, not from tiny.yaml
    default = None if any(a.startswith("train.init_from=") for a in args) else DEFAULT_CONFIG
    return config or default, args


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        path, overrides = arguments(argv)
    except SystemExit as e:
        return int(e.code)

    from jaxformer.data import DataError
    from jaxformer.model.config import ConfigError
    from jaxformer.training import TrainingStopped, load_config, train
    from jaxformer.training.checkpoint import CheckpointError
    from jaxformer.training.lock import RunDirInUse
    from jaxformer.training.supervise import supervised

    try:
        cfg = load_config(path, overrides)
        status = supervised(cfg)  # several processes: training runs in a child
        if status is not None:
            return status
        train(cfg)
    except (ConfigError, DataError, TrainingStopped, CheckpointError, RunDirInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code prints the Python stack that led to it
    sys.exit(main(sys.argv[1:]))
