"""jaxformer: a decoder-only transformer in JAX, written as pure-function Flax modules."""

from jaxformer.host_memory import keep_freed_memory

keep_freed_memory()  # before jax starts its CPU backend: see jaxformer/host_memory.py

from jaxformer.config import ConfigError, ModelConfig, RopeScaling
from jaxformer.decoding import beam_search, generate, kv_cache_bytes
from jaxformer.model import Transformer, flops_per_token, stack_layers, unstack_layers
from jaxformer.models import count_params, model_for, param_shapes

__all__ = [
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "beam_search",
    "count_params",
    "flops_per_token",
    "generate",
    "kv_cache_bytes",
    "model_for",
    "param_shapes",
    "stack_layers",
    "unstack_layers",
]
__version__ = "0.1.0"
