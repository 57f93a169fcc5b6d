"""A small text sampler for the end of a training run: temperature sampling by
recomputing the forward over a fixed-size buffer, compiled once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model import Transformer


def sample_tokens(model: Transformer, params, prompt: np.ndarray, *, length: int,
                  temperature: float, seed: int = 0) -> np.ndarray:
    """Extend `prompt` (1-D ids) to `length` tokens; temperature 0 is greedy."""
    prompt = np.asarray(prompt, np.int32)
    if not 0 < len(prompt) < length:
        raise ValueError(f"prompt of {len(prompt)} tokens must be non-empty and shorter than "
                         f"the sample length {length}")
    buf = jnp.zeros((1, length), jnp.int32).at[0, : len(prompt)].set(prompt)

    @jax.jit
    def run(params, buf, key):
        def body(i, carry):
            buf, key = carry
            logits = model.apply({"params": params}, buf)[0, i - 1]  # causal: later slots unseen
            key, sub = jax.random.split(key)
            if temperature == 0:
                tok = jnp.argmax(logits)
            else:
                tok = jax.random.categorical(sub, logits / temperature)
            return buf.at[0, i].set(tok.astype(jnp.int32)), key

        return jax.lax.fori_loop(len(prompt), length, body, (buf, key))[0]

    return np.asarray(run(params, buf, jax.random.key(seed))[0])
