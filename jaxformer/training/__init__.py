"""Training: run config, optimizer, train state and steps, checkpoints, metrics, loop."""

from jaxformer.training.config import (CheckpointConfig, MeshConfig, RunConfig, TrainConfig,
                                       load_config)
from jaxformer.training.loop import TrainingStopped, train
from jaxformer.training.optim import OptimConfig

__all__ = ["CheckpointConfig", "MeshConfig", "OptimConfig", "RunConfig", "TrainConfig",
           "TrainingStopped", "load_config", "train"]
