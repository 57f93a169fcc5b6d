"""The module of each model.arch (a table), and what is counted from it without
allocating: the param tree's shapes and the number of params.

    model = model_for(cfg)        # the Transformer (decoder, encoder) or the EncoderDecoder
    shapes = param_shapes(cfg)    # jax.ShapeDtypeStructs, via jax.eval_shape
    n = count_params(cfg)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.archs import ARCHS
from jaxformer.model.encoder_decoder import EncoderDecoder
from jaxformer.model.transformer import Transformer

# model.arch -> its module class (each Arch entry names its own)
MODELS = {name: {c.__name__: c for c in (Transformer, EncoderDecoder)}[arch.module]
          for name, arch in ARCHS.items()}


def model_for(cfg):
    """The flax module of cfg.arch (a ModelConfig's)."""
    return MODELS[cfg.arch](cfg)


def with_precision(model, precision: str | None):
    """model (a Transformer or EncoderDecoder) with its weight matmuls in
    model.matmul_precision=precision (None: as it is): a saved run decoded or scored in
    another precision than it trained in."""
    return model if precision is None else model.clone(
        cfg=model.cfg.replace(matmul_precision=precision))


def param_shapes(cfg):
    """The param tree of model_for(cfg) as jax.ShapeDtypeStructs (allocates nothing)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(model_for(cfg).init, jax.random.key(0), tokens)["params"]


def count_params(cfg) -> int:
    """The exact number of parameters of model_for(cfg), without allocating them."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(param_shapes(cfg))))
