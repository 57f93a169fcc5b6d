"""Hook points: named places in the forward pass where an activation can be read (cached)
or replaced (hooked), named as TransformerLens names them (`blocks.3.attn.hook_q`).

The modules call ``hook_point(self, "hook_q", q)`` at each place. Outside
``jaxformer.model.inspect`` no session is active and it returns its input untouched, adding
nothing to the traced program: the default forward pays nothing. A session is Python
state read while a function is traced, so what it records are that trace's values, and
the functions built on it compose with jit, vmap and grad.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import re
from typing import Callable

import jax


@dataclasses.dataclass
class Session:
    """What one run_with_cache / run_with_hooks call asks for, and what it recorded."""

    hooks: dict[str, Callable]  # name -> fn(value) -> value of the same shape and dtype
    keep: Callable[[str], bool]  # which names to record
    cache: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    seen: set[str] = dataclasses.field(default_factory=set)

    def wants(self, name: str) -> bool:
        return name in self.hooks or self.keep(name)


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "jaxformer_hook_session", default=None)

# module name -> TransformerLens's; the norms after a sublayer (sandwich, res_post_ln) are
# TransformerLens's ln1_post and ln2_post (its Gemma 2/3 and OLMo 2 adapters)
_PARTS = {"ffn": "mlp", "attn_norm": "ln1", "ffn_norm": "ln2", "final_norm": "ln_final",
          "attn_post_norm": "ln1_post", "ffn_post_norm": "ln2_post"}


def hook_name(path: tuple[str, ...], name: str) -> str:
    """A module path and a hook's name -> its TransformerLens name:
    ("block_3", "attn"), "hook_q" -> "blocks.3.attn.hook_q"; "ffn" is "mlp"."""
    parts = [re.sub(r"^block_(\d+)$", r"blocks.\1", p) for p in path]
    return ".".join([_PARTS.get(p, p) for p in parts] + [name])


@contextlib.contextmanager
def session(hooks: dict[str, Callable], keep: Callable[[str], bool],
            names: frozenset[str] = frozenset()):
    """Activates hooks and recording for the forward passes traced inside. At the end,
    every hooked name and every literal name in `names` must have been a hook point."""
    s = Session(hooks=dict(hooks), keep=keep)
    token = _SESSION.set(s)
    try:
        yield s
    finally:
        _SESSION.reset(token)
    _refuse_unknown(set(hooks), s.seen, "hooks on")
    _refuse_unknown(set(names), s.seen, "names")


def refuse_pattern_hooks(hooks: dict, who: str) -> None:
    """Refuses, in one line, hooks on attention patterns or scores for `who`, a KV-cached
    path (generate, the serving engine), which computes neither."""
    patterns = sorted(n for n in hooks if n.endswith(("hook_attn_scores", "hook_pattern")))
    if patterns:
        raise ValueError(f"{who} cannot hook {', '.join(patterns)}: the KV-cached path "
                         "computes no attention pattern; hook attn.hook_z or the residual "
                         "stream, or use jaxformer.model.inspect.run_with_hooks on the full "
                         "sequence")


def _refuse_unknown(asked: set[str], seen: set[str], what: str):
    unknown = sorted(asked - seen)
    if unknown:
        close = {n: difflib.get_close_matches(n, seen, n=1) for n in unknown}
        hints = ", ".join(f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "")
                          for n, c in close.items())
        raise ValueError(f"{what} {hints}: no such hook point in this model; run_with_cache "
                         f"lists them (e.g. blocks.0.hook_resid_pre, blocks.0.attn.hook_q)")


def active(module, *names: str) -> bool:
    """Whether the running session reads or hooks any of `names` at this module."""
    s = _SESSION.get()
    if s is None:
        return False
    full = [hook_name(module.path, n) for n in names]
    s.seen.update(full)  # places that exist, whether or not this run computes them
    return any(s.wants(n) for n in full)


def hook_point(module, name: str, x):
    """x, or what the session's hook for this place returns; recorded when asked for."""
    s = _SESSION.get()
    if s is None:
        return x
    full = hook_name(module.path, name)
    s.seen.add(full)
    fn = s.hooks.get(full)
    if fn is not None:
        y = fn(x)
        if getattr(y, "shape", None) != x.shape or getattr(y, "dtype", None) != x.dtype:
            raise ValueError(f"the hook on {full} must return its input's shape and dtype "
                             f"{x.shape} {x.dtype}; it returned "
                             f"{getattr(y, 'shape', type(y))} {getattr(y, 'dtype', '')}")
        x = y
    if s.keep(full):
        s.cache[full] = x
    return x
