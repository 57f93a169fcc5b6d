"""Scanned layers as runs: a scan stacks layers of one structure, so a model whose layers
differ (DeepSeek's first dense layers before its sparse ones, Qwen2-MoE's mlp_only_layers)
scans each run of consecutive alike layers on its own.

One run is named ``blocks`` (every model whose layers are alike: the params' layout is as
it always was); several are ``blocks_0``, ``blocks_1``, ... in layer order. Per-layer
params are ``block_0``, ``block_1``, ... whatever the runs.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

_STACKED = re.compile(r"blocks(_\d+)?")
_LAYER = re.compile(r"block_\d+")
_STACKS = ("encoder", "decoder")  # an encoder-decoder's stacks: each has layers of its own


class Run(NamedTuple):
    """Layers start .. stop - 1, stacked under `name`."""
    name: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def runs(alike: Sequence) -> tuple[Run, ...]:
    """The runs of consecutive equal entries of `alike` (one entry per layer: whatever
    decides its structure, e.g. whether its FFN is sparse)."""
    bounds = [0] + [i for i in range(1, len(alike)) if alike[i] != alike[i - 1]] + [len(alike)]
    spans = list(zip(bounds, bounds[1:]))
    names = ["blocks"] if len(spans) == 1 else [f"blocks_{j}" for j in range(len(spans))]
    return tuple(Run(n, a, b) for n, (a, b) in zip(names, spans))


def is_stacked(name: str) -> bool:
    """Whether a top-level params (or cache) key holds a run of stacked layers."""
    return _STACKED.fullmatch(name) is not None


def locate(layer_runs: Sequence[Run], i: int) -> tuple[str, int]:
    """Layer i -> (its run's name, its index in the run)."""
    for r in layer_runs:
        if r.start <= i < r.stop:
            return r.name, i - r.start
    raise IndexError(f"layer {i} is in none of the runs {[tuple(r) for r in layer_runs]}")


def _has_stacks(params) -> bool:
    """Whether params are an encoder-decoder's: its layers under encoder/ and decoder/."""
    return all(n in params for n in _STACKS)


def stack_layers(params, n_layers: int):
    """Per-layer params {block_0, ..., block_{L-1}} -> stacked runs {blocks: [L, ...]} (or
    {blocks_0: [L0, ...], blocks_1: ...} where consecutive layers' structures differ). An
    encoder-decoder's are stacked in each of encoder/ and decoder/ (the decoder's n_layers
    layers, and every block_i the encoder holds)."""
    if _has_stacks(params):
        encoder = params["encoder"]
        n_encoder = sum(_LAYER.fullmatch(n) is not None for n in encoder)
        return {**params, "encoder": stack_layers(encoder, n_encoder),
                "decoder": stack_layers(params["decoder"], n_layers)}
    params = dict(params)
    missing = [f"block_{i}" for i in range(n_layers) if f"block_{i}" not in params]
    if missing:
        raise KeyError(f"stack_layers needs per-layer params; {', '.join(missing)} missing "
                       f"(found {', '.join(sorted(params))})")
    layers = [params.pop(f"block_{i}") for i in range(n_layers)]
    shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), layer) for layer in layers]
    for r in runs([(jax.tree.structure(s), jax.tree.leaves(s)) for s in shapes]):
        params[r.name] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers[r.start:r.stop])
    return params


def unstack_layers(params):
    """Stacked runs {blocks: [L, ...]} (or blocks_0, blocks_1, ...) -> per-layer
    {block_0, ..., block_{L-1}}; an encoder-decoder's in each of encoder/ and decoder/."""
    if _has_stacks(params):
        return {**params, **{n: unstack_layers(params[n]) for n in _STACKS}}
    params = dict(params)
    names = sorted((n for n in params if is_stacked(n)),
                   key=lambda n: -1 if n == "blocks" else int(n[7:]))
    if not names:
        raise KeyError(f"unstack_layers needs stacked params under 'blocks' "
                       f"(found {', '.join(sorted(params))})")
    i = 0
    for name in names:
        stacked = params.pop(name)
        for j in range(jax.tree.leaves(stacked)[0].shape[0]):
            params[f"block_{i}"] = jax.tree.map(lambda x, j=j: x[j], stacked)
            i += 1
    return params
