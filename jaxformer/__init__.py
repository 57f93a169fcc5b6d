"""jaxformer: a decoder-only transformer in JAX, written as pure-function Flax modules."""

from jaxformer.config import ConfigError, ModelConfig, RopeScaling
from jaxformer.model import (
    Transformer,
    count_params,
    flops_per_token,
    param_shapes,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "count_params",
    "flops_per_token",
    "param_shapes",
    "stack_layers",
    "unstack_layers",
]
__version__ = "0.1.0"
