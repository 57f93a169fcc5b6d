"""Experiments on a model's activations: read them (run_with_cache), change them
(run_with_hooks), the logit lens, and head-ablation and activation-patching sweeps. Names,
shapes and meanings are TransformerLens's (`blocks.3.attn.hook_pattern`); the docs' page
"Inspecting a model" (docs/inspecting.md) lists them.

A sparse layer (jaxformer.moe.experts) shows its routing as TransformerLens 4 names it:
`blocks.i.mlp.gate.hook_out` (router logits [B, T, E]), `hook_expert_indices` [B, T, k]
and `hook_expert_weights` [B, T, E] (0 where not chosen); a hook that sets an expert's
column of the weights to 0 switches that expert off (tests/moe/test_moe_generation.py).

Everything here is a pure function of (params, tokens, hooks), so it composes with
jax.jit, jax.vmap (e.g. one call over a batch of interventions) and jax.grad (e.g.
attribution patching). With scan_layers or remat, the model is run as its per-layer loop
without remat: the same math (tests/model/test_transformer.py: scan == loop, remat == none), with
names per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from jaxformer.core.hooks import session
from jaxformer.model.kinds import BLOCKS
from jaxformer.model.norms import normalize, scale_and_shift
from jaxformer.model.transformer import Transformer, unstack_layers

Names = Iterable[str] | Callable[[str], bool] | None


def _as_loop(model: Transformer, params):
    """The model as inspection runs it (per-layer loop, no remat) and its params."""
    cfg = model.cfg
    if cfg.scan_layers:
        params = unstack_layers(params)
    return Transformer(dataclasses.replace(cfg, scan_layers=False, remat="none")), params


def _keep(names: Names) -> tuple[Callable[[str], bool], set[str]]:
    """A predicate over names, and the literal names that must exist."""
    if names is None:
        return (lambda _: True), set()
    if callable(names):
        return names, set()
    wanted = {names} if isinstance(names, str) else set(names)
    return wanted.__contains__, wanted


def run_with_hooks(model: Transformer, params, tokens, *, hooks: dict[str, Callable],
                   positions=None, segment_ids=None, return_cache: bool = False,
                   names: Names = None):
    """Logits [B, T, V] of the forward pass with each hook's fn(value) -> value (same shape
    and dtype) applied where its name is: what it returns flows on from there. With
    return_cache, (logits, cache) where cache holds the names asked for (default: all)
    as they flowed, hooks applied."""
    loop, params = _as_loop(model, params)
    keep, asked = _keep(names) if return_cache else ((lambda _: False), set())
    with session(hooks, keep, frozenset(asked)) as s:
        logits = loop.apply({"params": params}, tokens, positions=positions,
                            segment_ids=segment_ids)
    return (logits, dict(s.cache)) if return_cache else logits


def run_with_cache(model: Transformer, params, tokens, *, positions=None, segment_ids=None,
                   names: Names = None):
    """(logits [B, T, V], cache): cache maps each hook point's name to its value in this
    forward pass. `names` (a list of names, or a predicate on a name) keeps only those;
    by default all are kept. Attention patterns and scores are computed through the
    reference attention, and only when kept."""
    return run_with_hooks(model, params, tokens, hooks={}, positions=positions,
                          segment_ids=segment_ids, return_cache=True, names=names)


def logit_lens(model: Transformer, params, cache):
    """The logits read from every layer's residual stream: each `blocks.{i}.hook_resid_post`
    through what the model does after its last block: the final norm (all but post-LN
    blocks; with its scale, 1 + scale for rmsnorm_offset, and bias), the LM head, the
    logits' multiplier and soft-cap.
    -> float32 [n_layers, B, T, V]; the last layer's equals the model's logits."""
    cfg = model.cfg
    _, params = _as_loop(model, params)
    missing = [f"blocks.{i}.hook_resid_post" for i in range(cfg.n_layers)
               if f"blocks.{i}.hook_resid_post" not in cache]
    if missing:
        raise ValueError(f"logit_lens needs {', '.join(missing)} in the cache; run "
                         "run_with_cache with those names (or all)")
    x = jnp.stack([cache[f"blocks.{i}.hook_resid_post"] for i in range(cfg.n_layers)])
    if not BLOCKS[cfg.block].ends_in_norm:  # post-LN blocks end in a norm (Transformer.logits)
        x = scale_and_shift(cfg, params["final_norm"], normalize(cfg, x)).astype(cfg.dtype)
    head = (params["embed"]["embedding"].T if cfg.tie_embeddings
            else params["lm_head"]["kernel"]).astype(cfg.dtype)  # [D, V]
    logits = jnp.einsum("lbtd,dv->lbtv", x.astype(cfg.dtype), head,
                        preferred_element_type=jnp.float32)
    if cfg.logits_multiplier != 1.0:
        logits = logits * jnp.float32(cfg.logits_multiplier)
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def next_token_loss(logits, tokens):
    """Mean next-token cross entropy of logits [B, T, V] on tokens [B, T] (T - 1 targets)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _sweep(fn, *sizes):
    """fn(i, j) over the grid arange(sizes[0]) x arange(sizes[1]), as one vmapped call."""
    return jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(*map(jnp.arange, sizes))


def head_ablation_sweep(model: Transformer, params, tokens, *, value: float = 0.0):
    """The next-token loss change when one head is ablated (its `attn.hook_z` set to
    `value`), for every (layer, head), all in one vmapped forward pass.
    -> float32 [n_layers, n_heads]: ablated loss minus clean loss."""
    cfg = model.cfg

    def ablated(layer, head):
        def ablate(i):
            off = (layer == i) & (jnp.arange(cfg.n_heads) == head)[:, None]  # [N, 1]
            return lambda z: jnp.where(off, jnp.asarray(value, z.dtype), z)

        hooks = {f"blocks.{i}.attn.hook_z": ablate(i) for i in range(cfg.n_layers)}
        return next_token_loss(run_with_hooks(model, params, tokens, hooks=hooks), tokens)

    clean = next_token_loss(run_with_hooks(model, params, tokens, hooks={}), tokens)
    return _sweep(ablated, cfg.n_layers, cfg.n_heads) - clean


def patching_sweep(model: Transformer, params, clean, corrupted, metric, *,
                   name: str = "hook_resid_pre"):
    """Activation patching: metric(logits) of the corrupted run with `blocks.{layer}.{name}`
    at one position replaced by the clean run's, for every (layer, position), in one
    vmapped call. clean, corrupted: tokens [B, T] of the same shape; metric: logits
    [B, T, V] -> a scalar (e.g. a logit difference). -> [n_layers, T]"""
    cfg, t = model.cfg, clean.shape[1]
    names = [f"blocks.{i}.{name}" for i in range(cfg.n_layers)]
    _, cache = run_with_cache(model, params, clean, names=names)

    def patched(layer, position):
        def patch(i):
            here = (layer == i) & (jnp.arange(t) == position)  # [T]
            return lambda x: jnp.where(here.reshape(1, t, *(1,) * (x.ndim - 2)),
                                       cache[names[i]], x)

        hooks = {n: patch(i) for i, n in enumerate(names)}
        return metric(run_with_hooks(model, params, corrupted, hooks=hooks))

    return _sweep(patched, cfg.n_layers, t)
