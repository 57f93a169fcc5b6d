"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): model.mtp_depth
modules after the main model, module k predicting token t_{i+k+1} at position i.

Module k reads the previous depth's hidden state h^{k-1}_i (depth 0: the main model's
last block output, before the final norm) and the embedding of token t_{i+k}:

    h'_i = eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]      (2 D -> D, no bias)
    h^k_i = Block(h')_i                                          (the last layer's kind)
    logits^k_i = Head(norm(h^k_i))

with the model's embedding table and LM head (Transformer.logits without its final norm:
each module has its own output norm, `norm`, as DeepSeek-V3's checkpoints hold
shared_head.norm per module). The concatenation puts the embedding first, as those
checkpoints' eh_proj reads it. The block attends over the module's own earlier
positions (causal, within a packed segment); decoding keeps a KV cache of it
(init_module_cache), a one-layer cache of block_config.

Params: mtp_1 ... mtp_D beside the main model's, each {enorm, hnorm, eh_proj, block,
norm}. The loss: jaxformer.training.objectives.language_model; the draft proposer:
jaxformer.decode.speculative (mtp).

A block with experts (the last layer sparse) is balanced as the sparse layers are
(jaxformer.moe.balancing): its statistics follow theirs, one row per depth (with_modules),
in the penalty and the moe_* metrics (logged per module as moe_load/mtp_k), and with
model.moe.bias_update_rate its score_bias moves by its own load (rebalanced_modules).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention.kv_cache import init_cache
from jaxformer.core.sharding import init_with_names
from jaxformer.model.blocks import Block, apply_norm, make_norm
from jaxformer.model.config import ModelConfig
from jaxformer.model.kinds import REMATS
from jaxformer.model.self_attention import dense_init
from jaxformer.moe.balancing import rebalanced, sparse_ids
from jaxformer.moe.experts import balanced_bias

MAX_DEPTH = 8  # model.mtp_depth's largest value (the losses logged: mtp_loss_1 .. _8)


def shifted(tokens, k: int, fill: int = 0):
    """tokens [B, T] moved k to the left: out[:, i] = tokens[:, i + k], `fill` past the end."""
    b, t = tokens.shape
    pad = jnp.full((b, min(k, t)), fill, tokens.dtype)
    rest = jax.lax.slice_in_dim(tokens, min(k, t), t, axis=1)  # (an abstract input too)
    return jnp.concatenate([rest, pad], axis=1)  # [B, T]


def embedded(cfg: ModelConfig, table, tokens):
    """Emb(tokens): the embedding table's rows [B, T, D] in the compute dtype, times the
    model's embed_multiplier (no position terms: the block's own scheme adds those)."""
    x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)
    if cfg.embed_multiplier != 1.0:
        x = x * jnp.asarray(cfg.embed_multiplier, cfg.dtype)
    return x


def block_config(cfg: ModelConfig) -> ModelConfig:
    """A one-layer model of the MTP block's layer (the last layer's kind, mixer and FFN):
    what its KV cache is shaped by."""
    last = cfg.n_layers - 1
    pattern = ()
    if cfg.layer_pattern:
        pattern = (cfg.layer_kinds[cfg.layer_kind_ids[last]][0],)
    moe = cfg.moe.replace(layers=(0,) if cfg.sparse_layers[last] else ()) \
        if cfg.moe.experts else cfg.moe
    return cfg.replace(n_layers=1, layer_pattern=pattern, moe=moe, scan_layers=False)


def init_module_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None):
    """An empty KV cache of one MTP module's block (layers: {"block_0": ...})."""
    return init_cache(block_config(cfg), batch, max_len, dtype)


def sparse_modules(cfg: ModelConfig) -> list[str]:
    """The names of the MTP modules whose block has experts (mtp_1 .. mtp_D where the last
    layer is sparse, else none)."""
    if not cfg.mtp_depth or not cfg.sparse_layers[-1]:
        return []
    return [f"mtp_{k}" for k in range(1, cfg.mtp_depth + 1)]


def moe_rows(cfg: ModelConfig) -> list:
    """What each row of a step's MoE statistics is logged under (moe_load/NAME): each
    sparse layer's index, then each sparse MTP module's name (with_modules' order)."""
    return sparse_ids(cfg) + sparse_modules(cfg)


def with_modules(cfg: ModelConfig, stats: dict, sown) -> dict:
    """The sparse layers' statistics (jaxformer.moe.balancing.layer_stats: [Ls, ...] each)
    followed by the MTP modules' from the same forward's "moe" collection: [Ls + D, ...]
    (unchanged where their block has no experts)."""
    names = sparse_modules(cfg)
    if not names:
        return stats
    more = [sown[n]["block"]["ffn"]["stats"][0] for n in names]  # one forward each
    return jax.tree.map(lambda main, *rows: jnp.concatenate([main, jnp.stack(rows)]),
                        stats, *more)


def rebalanced_modules(cfg: ModelConfig, params, old, load, finite):
    """params with each sparse MTP module's score_bias set to balanced_bias(its value in
    `old`, its row of the step's load [Ls + D, E] (the last D), model.moe.
    bias_update_rate), as balancing.rebalanced sets the sparse layers'; a skipped step
    (finite False) keeps the old bias. Unchanged where load holds no module rows (stats
    not gathered by with_modules)."""
    names = sparse_modules(cfg)
    if load.shape[0] != sum(cfg.sparse_layers) + len(names):
        return params
    params = dict(params)
    for name, row in zip(names, load[load.shape[0] - len(names):]):
        before = old[name]["block"]["ffn"]["score_bias"]
        bias = jnp.where(finite, balanced_bias(before, row, cfg.moe.bias_update_rate), before)
        ffn = {**params[name]["block"]["ffn"], "score_bias": bias.astype(before.dtype)}
        params[name] = {**params[name], "block": {**params[name]["block"], "ffn": ffn}}
    return params


def rebalanced_all(cfg: ModelConfig, params, old, load, finite):
    """A step's bias update (model.moe.bias_update_rate): every sparse layer's score_bias
    (balancing.rebalanced, from load's first rows), then each sparse module's."""
    params = rebalanced(cfg, params, old, load, finite)
    return rebalanced_modules(cfg, params, old, load, finite)


class MTPModule(nn.Module):
    """One MTP depth: (h^{k-1} [B, T, D], Emb(t_{i+k}) [B, T, D]) -> (h^k [B, T, D], its
    normed form for the head [B, T, D], the block's cache or None). positions, mask (one
    MaskRule per kind), bias and segments as the model's blocks take them."""

    cfg: ModelConfig
    deterministic: bool = True
    impl: str | None = None

    @nn.compact
    def __call__(self, previous, embeddings, positions, mask, bias=None, cache=None,
                 index=None, segments=None):
        c = self.cfg
        x = jnp.concatenate([apply_norm(c, make_norm(c, "enorm"), embeddings),
                             apply_norm(c, make_norm(c, "hnorm"), previous)], axis=-1)  # [B, T, 2D]
        x = nn.Dense(c.d_model, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
                     kernel_init=init_with_names(dense_init(), "mlp", "embed"),
                     name="eh_proj")(x)  # [B, T, D]
        block = Block
        remat = REMATS[c.remat]
        if remat.on:
            block = nn.remat(block, policy=remat.policy)
        last = c.n_layers - 1
        block = block(c, self.deterministic, impl=self.impl, kind=c.layer_kind_ids[last],
                      sparse=c.sparse_layers[last], mixer=c.layer_mixers[last],
                      ffn=c.layer_ffns[last], parallel=c.layer_parallels[last], name="block")
        if cache is None:
            h = block(x, positions, mask, bias, segments=segments)
        else:
            h, cache = block(x, positions, mask, bias, cache, index, segments=segments)
        return h, apply_norm(c, make_norm(c, "norm"), h), cache
