"""Experiments on a model's activations: read them (run_with_cache), change them
(run_with_hooks), and the logit lens. Names, shapes and meanings are TransformerLens's
(`blocks.3.attn.hook_pattern`); README "Inspecting a model" lists them.

Everything here is a pure function of (params, tokens, hooks), so it composes with
jax.jit, jax.vmap (e.g. one call over a batch of interventions) and jax.grad (e.g.
attribution patching). With scan_layers or remat, the model is run as its per-layer loop
without remat: the same math (tests/test_model.py: scan == loop, remat == none), with
names per layer.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Iterable

import jax.numpy as jnp

from jaxformer.hooks import session
from jaxformer.layers import normalize
from jaxformer.model import Transformer, unstack_layers

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


def _check_names(asked: set[str], seen: set[str], what: str):
    unknown = sorted(asked - seen)
    if unknown:
        close = {n: difflib.get_close_matches(n, seen, n=1) for n in unknown}
        hints = ", ".join(f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "")
                          for n, c in close.items())
        raise ValueError(f"{what} {hints}: no such hook point in this model; run_with_cache "
                         f"lists them (e.g. blocks.0.hook_resid_pre, blocks.0.attn.hook_q)")


def run_with_hooks(model: Transformer, params, tokens, *, hooks: dict[str, Callable],
                   positions=None, segment_ids=None, return_cache: bool = False,
                   names: Names = None):
    """Logits [B, T, V] of the forward pass with each hook's fn(value) -> value (same shape
    and dtype) applied where its name is: what it returns flows on from there. With
    return_cache, (logits, cache) where cache holds the names asked for (default: all)
    as they flowed, hooks applied."""
    loop, params = _as_loop(model, params)
    keep, asked = _keep(names) if return_cache else ((lambda _: False), set())
    with session(hooks, keep) as s:
        logits = loop.apply({"params": params}, tokens, positions=positions,
                            segment_ids=segment_ids)
    _check_names(set(hooks), s.seen, "hooks on")
    _check_names(asked, s.seen, "names")
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
    through the final norm (pre-LN; with its scale and bias) and the LM head.
    -> float32 [n_layers, B, T, V]; the last layer's equals the model's logits."""
    cfg = model.cfg
    _, params = _as_loop(model, params)
    missing = [f"blocks.{i}.hook_resid_post" for i in range(cfg.n_layers)
               if f"blocks.{i}.hook_resid_post" not in cache]
    if missing:
        raise ValueError(f"logit_lens needs {', '.join(missing)} in the cache; run "
                         "run_with_cache with those names (or all)")
    x = jnp.stack([cache[f"blocks.{i}.hook_resid_post"] for i in range(cfg.n_layers)])
    x = x.astype(jnp.float32)
    if cfg.block == "pre_ln":
        norm = params["final_norm"]
        x = normalize(cfg, x) * norm["scale"].astype(jnp.float32)
        if "bias" in norm:
            x = x + norm["bias"].astype(jnp.float32)
        x = x.astype(cfg.dtype)
    head = (params["embed"]["embedding"].T if cfg.tie_embeddings
            else params["lm_head"]["kernel"]).astype(cfg.dtype)  # [D, V]
    return jnp.einsum("lbtd,dv->lbtv", x, head, preferred_element_type=jnp.float32)
