"""Several LoRA adapters trained side by side in one program (model.lora.sweep_rank,
model.lora.sweep_seeds): a sweep.

The adapters share the frozen base and every batch; each has its own A, B and alpha / r
(lora_scale) stacked on a leading member axis, and its own optimizer state. The train
step runs the model once per member under jax.vmap and differentiates the sum of the
members' losses (each member's gradient is its own loss's: they share no trained param);
the optimizer update is vmapped too, so clipping, skipping and the moments are each
member's, as in separate runs. Ranks differ by zero padding to the largest: A's extra
columns and B's extra rows start at 0 and get zero gradients (each is multiplied by the
other's zeros), so AdamW and its decay leave them at 0 and a member of rank r computes
exactly what a rank-r adapter does; A is drawn column by column, so its first r columns
are a rank-r run's with the same model.lora.seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxformer.core.validation import ConfigError
from jaxformer.model import lora
from jaxformer.model.layer_runs import is_stacked


def members(model) -> int:
    """How many adapters the model's config trains at once (1: no sweep). A sweep of a
    mixture-of-experts model is refused: its members would share one score_bias."""
    n = len(model.cfg.lora.members())
    if n > 1 and any(model.cfg.sparse_layers):
        raise ConfigError("a LoRA sweep (model.lora.sweep_rank / sweep_seeds) of a mixture-of-"
                          "experts model (model.moe.experts > 0) is not supported: train its "
                          "adapters one run at a time")
    return n


def sweep_params(model, key, tokens):
    """Fresh params of a sweep: the base once, each member's adapters (from its own
    rank and seed) padded to the largest rank and stacked on axis 0."""
    from jaxformer.model.transformer import Transformer
    cfg, width = model.cfg, model.cfg.lora.rank
    inits = [Transformer(cfg.replace(lora=m)).init(key, tokens)["params"]
             for m in cfg.lora.members()]

    def pad(path, x):  # A [L.., in..., r] on its last axis, B [L.., r, out...] on r's
        axis = x.ndim - 1 if path[-1].key == "lora_a" else int(is_stacked(path[0].key))
        if path[-1].key == lora.SCALE:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, width - x.shape[axis])
        return jnp.pad(x, widths)

    parts = [lora.partition(p, scales=True) for p in inits]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[jax.tree_util.tree_map_with_path(pad, lora.combine(a, s))
                             for a, s, _ in parts])
    return lora.combine(stacked, parts[0][2])


def sweep_specs(specs):
    """Logical PartitionSpecs of a sweep's params: the member axis (unsharded) in front of
    each adapter leaf's."""
    def prepend(path, spec):
        leaf = path[-1].key
        return P(None, *spec) if leaf in lora.PARAMS + (lora.SCALE,) else spec
    return jax.tree_util.tree_map_with_path(prepend, specs,
                                            is_leaf=lambda x: isinstance(x, P))


def member_losses(loss_fn, trained, frozen):
    """loss_fn(params) -> (total, count) for each member: totals [S] and the count (the
    same batch for all)."""
    scales, base = lora.partition(frozen, scales=True)[1:]
    totals, counts = jax.vmap(lambda t, s: loss_fn(lora.combine(t, s, base)))(trained, scales)
    return totals, counts[0]
