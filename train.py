"""Train a model: python train.py [configs/NAME.yaml] [section.key=value ...]

    python train.py                                   # configs/tiny.yaml
    python train.py configs/gpt2_small.yaml train.steps=2000 optim.lr=6e-4
    python train.py train.init_from=HF_DIR model.lora.rank=8    # no default config file
"""

from __future__ import annotations

import faulthandler
import sys

DEFAULT_CONFIG = "configs/tiny.yaml"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    overrides = [a for a in argv if "=" in a]
    # fine-tuning (train.init_from) takes its model from the weights, not from tiny.yaml
    default = None if any(a.startswith("train.init_from=") for a in overrides) else DEFAULT_CONFIG
    path = argv[0] if argv and "=" not in argv[0] else default
    stray = [a for a in argv if "=" not in a and a != path]
    if stray:
        print(f"error: unexpected argument(s) {' '.join(stray)}; usage: python train.py "
              "[configs/NAME.yaml] [section.key=value ...]", file=sys.stderr)
        return 2

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
