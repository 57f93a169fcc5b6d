"""Which Hugging Face tensors hold which jaxformer params, and the exact reshapes between them.

A ``Rule`` ties a group of HF tensors to a group of our params with a function each way, so
loading and saving are one table read in two directions (and a round trip is exact: only
transposes, reshapes, splits and concatenations). Each tensor layout's rules are its
module's ``tensor_rules`` (jaxformer.hf.gpt2, gpt_neox, llama_layout), named as the
``*ForCausalLM`` / ``GPT2LMHeadModel`` checkpoints name them; a bare-model checkpoint lacks
the prefix (its row's tensor_prefix), which the reader allows. Here are the pieces they share.

Our layout (jaxformer.model.transformer): embed/embedding [V, D]; per block attn/{query [D, N, H],
key/value [D, K, H], out [N, H, D]} kernels, q/k/v biases [N|K, H]; ffn/{wi | wi_gate,
wi_up} [D, F], wo [F, D]; norms' scale (and LayerNorm bias) [D]; lm_head/kernel [D, V].
HF Linear weights are [out, in].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

Path = tuple[str, ...]
ROPE_LAYOUTS = ("half", "interleaved")


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: tuple[Path, ...]                     # param paths
    hf: tuple[str, ...]                        # HF tensor names
    hf_shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[..., tuple[np.ndarray, ...]]  # HF arrays -> our arrays
    to_hf: Callable[..., tuple[np.ndarray, ...]]    # our arrays -> HF arrays


def permute_interleaved_to_half(x):
    """RoPE layout of the last (head_dim) axis: interleaved pairs (2i, 2i+1), as Meta's
    original Llama checkpoints, -> half rotation (i, i + head_dim/2), as HF and jaxformer.
    This is the permutation of transformers' convert_llama_weights_to_hf."""
    h = x.shape[-1]
    return x.reshape(*x.shape[:-1], h // 2, 2).swapaxes(-1, -2).reshape(x.shape)


def permute_half_to_interleaved(x):
    """The inverse of permute_interleaved_to_half."""
    h = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, h // 2).swapaxes(-1, -2).reshape(x.shape)


def rope_permutation(rope_layout: str, rot: int | None = None):
    """(to_ours, to_hf) of the q/k last axis for a checkpoint's RoPE layout; None for half.
    rot: the rotated dimensions, a head's first (None: all of them); the others pass
    through as they are."""
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope_layout={rope_layout!r} is not one of {', '.join(ROPE_LAYOUTS)}")
    if rope_layout == "interleaved":
        return _on_first(permute_interleaved_to_half, rot), \
            _on_first(permute_half_to_interleaved, rot)
    return None


def _on_first(permute, rot: int | None):
    """`permute` of the first rot entries of the last axis alone (None: of all)."""
    if rot is None:
        return permute
    return lambda x: np.concatenate([permute(x[..., :rot]), x[..., rot:]], axis=-1)


def one_tensor(path: Path, name: str, hf_shape, to_ours, to_hf) -> Rule:
    return Rule((path,), (name,), (tuple(hf_shape),), lambda w: (to_ours(w),),
                lambda k: (to_hf(k),))


def copied(path: Path, name: str, shape) -> Rule:
    return one_tensor(path, name, shape, lambda w: w, lambda k: k)


def reshaped(path: Path, name: str, hf_shape, shape, post=None) -> Rule:
    """Same element order, another shape (Conv1D kernels, biases); `post` (an involution
    pair (to_ours, to_hf)) permutes the last axis of ours afterwards."""
    fwd, inv = post or (lambda x: x, lambda x: x)
    return one_tensor(path, name, hf_shape, lambda w: fwd(w.reshape(shape)),
                      lambda k: inv(k).reshape(hf_shape))


def linear(path: Path, name: str, hf_shape, shape, post=None) -> Rule:
    """torch Linear weight [out, in] -> kernel [in, out] reshaped to `shape`."""
    fwd, inv = post or (lambda x: x, lambda x: x)
    return one_tensor(path, name, hf_shape, lambda w: fwd(w.T.reshape(shape)),
                      lambda k: inv(k).reshape(hf_shape[::-1]).T)


def split_rows(block_path, names, hf_name, sizes, d, shapes) -> Rule:
    """One fused Linear [sum(sizes), D] <-> kernels [D, size] reshaped to `shapes`."""
    cuts = list(np.cumsum(sizes)[:-1])
    return Rule(tuple(block_path + (n, "kernel") for n in names), (hf_name,), ((sum(sizes), d),),
                lambda w: tuple(x.T.reshape(shape) for x, shape in
                                zip(np.split(w, cuts, axis=0), shapes)),
                lambda *ks: (np.concatenate([k.reshape(d, -1).T for k in ks], axis=0),))
