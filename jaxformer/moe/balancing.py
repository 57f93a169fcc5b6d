"""Mixture-of-experts training: the sparse layers' statistics read from the "moe"
collection they sow (jaxformer.model.blocks.MoEFeedForward), the balancing penalty the train
loss adds, DeepSeek-V3's bias update after each step, and the per-layer metrics.

A forward's statistics, stacked over the sparse layers (Ls of them, in layer order):
load [Ls, E] (assignments per expert), aux [Ls] (the switch load-balancing loss), z [Ls]
(the router z-loss), dropped [Ls] (the share of assignments over capacity).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.moe.experts import balanced_bias


def sparse_ids(cfg) -> list[int]:
    """The indices of the model's sparse layers (cfg a ModelConfig)."""
    return [i for i, sparse in enumerate(cfg.sparse_layers) if sparse]


def layer_stats(cfg, sown) -> dict:
    """The "moe" collection of a forward -> its statistics stacked over the sparse layers.
    Unscanned each layer sows block_i/ffn/stats; scanned, each sparse run's
    blocks.../ffn/stats holds them stacked over its layers. Each is a 1-tuple (one
    forward)."""
    if cfg.scan_layers:
        runs = [sown[r.name]["ffn"]["stats"][0] for r in sparse_runs(cfg)]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *runs) if runs else {}
    layers = [sown[f"block_{i}"]["ffn"]["stats"][0] for i in sparse_ids(cfg)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)  # [Ls, ...] each


def sparse_runs(cfg) -> list:
    """The scanned runs (cfg.layer_runs) of sparse layers, in layer order."""
    return [r for r in cfg.layer_runs if cfg.sparse_layers[r.start]]


def penalty(moe, stats: dict):
    """The balancing penalty per token: aux_loss x the mean over sparse layers of aux, plus
    z_loss x the mean of z (float32 scalar; 0 for a dense model)."""
    if not stats:
        return jnp.float32(0)
    return moe.aux_loss * jnp.mean(stats["aux"]) + moe.z_loss * jnp.mean(stats["z"])


def step_sums(stats: dict, count) -> dict:
    """What a step adds up over its micro-batches: aux and z weighted by the micro-batch's
    token count (as they enter the summed loss), load and dropped as they are."""
    if not stats:
        return {}
    return {"aux": count * stats["aux"], "z": count * stats["z"], "load": stats["load"],
            "dropped": stats["dropped"]}


def step_metrics(sums: dict, count, micro_batches: int) -> dict:
    """A step's MoE metrics from its sums: moe_aux and moe_z (the token-weighted means that
    entered the loss, averaged over the sparse layers), and per sparse layer [Ls]
    moe_load (max / mean assignments per expert over the step's tokens: 1 is balanced,
    E / top_k is every token on the same experts) and moe_dropped."""
    if not sums:
        return {}
    load = sums["load"]  # [Ls, E]
    return {"moe_aux": jnp.mean(sums["aux"]) / count, "moe_z": jnp.mean(sums["z"]) / count,
            "moe_load": jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9),
            "moe_dropped": sums["dropped"] / micro_batches}


def rebalanced(cfg, params, old, load, finite):
    """params with every sparse layer's score_bias set to balanced_bias(its value in `old`
    (the params before the step), the step's load [Ls, E], model.moe.bias_update_rate):
    whatever the optimizer did to that leaf is overwritten. A skipped step (finite False)
    keeps the old bias, as it keeps every other param."""
    rate = cfg.moe.bias_update_rate
    if cfg.scan_layers:  # score_bias [L, E] per run; load [Ls, E] the runs' in order
        ends = np.cumsum([0] + [r.length for r in sparse_runs(cfg)])
        places = [(r.name, load[a:b]) for r, a, b in zip(sparse_runs(cfg), ends, ends[1:])]
    else:
        places = [(f"block_{i}", load[j]) for j, i in enumerate(sparse_ids(cfg))]
    params = dict(params)
    for name, layer_load in places:
        before = old[name]["ffn"]["score_bias"]
        bias = jnp.where(finite, balanced_bias(before, layer_load, rate), before)
        ffn = {**params[name]["ffn"], "score_bias": bias.astype(before.dtype)}
        params[name] = {**params[name], "ffn": ffn}
    return params


def layer_records(ids: list[int], metrics) -> dict:
    """A step's MoE metrics (fetched to the host) as metrics.jsonl keys: moe_aux, moe_z and,
    for each sparse layer i, moe_load/i and moe_dropped/i."""
    out = {k: float(metrics[k]) for k in ("moe_aux", "moe_z") if k in metrics}
    for key in ("moe_load", "moe_dropped"):
        if key in metrics:
            out.update({f"{key}/{i}": float(v) for i, v in zip(ids, metrics[key])})
    return out
