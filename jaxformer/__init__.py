"""jaxformer: transformers in JAX (decoders, encoders, encoder-decoders), written as
pure-function Flax modules.

The package is in wings, bottom up (tests/test_layout.py holds which may import which):
core, positions, attention, moe, model, decode, hf, data, training, eval, convert,
experiments. The names below are the public surface; each has one home in a wing."""

from jaxformer.core.host_memory import keep_freed_memory

keep_freed_memory()  # before jax starts its CPU backend: see jaxformer/core/host_memory.py

from jaxformer.core import moved

moved.install()  # an old module path (jaxformer.decoding) fails naming its new home

from jaxformer.decode.beam import beam_search
from jaxformer.decode.loops import generate, kv_cache_bytes
from jaxformer.model.build import count_params, model_for, param_shapes
from jaxformer.model.config import ConfigError, ModelConfig, RopeScaling
from jaxformer.model.transformer import Transformer, flops_per_token, stack_layers, unstack_layers

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
