"""Train a model: python train.py [configs/NAME.yaml] [key=value ...]."""

import sys


def main() -> int:
    print("jaxformer: training is not yet implemented (it arrives with the training loop); "
          "the model itself is ready: see README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
