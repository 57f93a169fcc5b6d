"""The attention backends as a table: one Backend per `attention_impl`, saying what it
reads (a mask array, or the MaskRule a block at a time), whether and how it takes a
logit bias, and where `auto` picks it and why (its rule: jaxformer.attention.rules). Config
validation, `auto`, the dispatch below and the tests read it; a new backend is one entry
(``BACKENDS[name] = Backend(...)``) plus its function.

Two ways in: ``dot_product_attention`` (a mask and a bias as arrays; every backend that
takes arrays) and ``rule_attention`` (the model's path: the mask as a MaskRule, the bias
as a LogitBias, each handed to the backend in the form it reads). Both take a logit
soft-cap (``softcap``, Gemma 2: s -> softcap * tanh(s / softcap) after the scale, before
the bias and the mask), which only the backends with takes_softcap apply (naming another
raises; `auto` never picks one), attention sinks (``sinks`` [N], gpt-oss: a logit per query
head in every row's softmax, jaxformer.core.reference) likewise with takes_sinks, and a
contextual scheme (CoPE) likewise.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from jaxformer.attention import rules
from jaxformer.attention.blockwise import blockwise_attention, index_bias
from jaxformer.attention.chunked import chunked_attention
from jaxformer.attention.masks import MaskRule
from jaxformer.attention.ring import context_attention
from jaxformer.attention.rules import (DENSE_LOGITS_BYTES, GATHERED_KV_BYTES, Setting,  # noqa: F401
                                       scheme_kind)
from jaxformer.attention.splash import splash_attention
from jaxformer.core.reference import and_causal, as_4d, check_softcap, reference_attention
from jaxformer.core.sharding import sequence_split
from jaxformer.core.validation import ConfigError
from jaxformer.positions.schemes import POSITION_SCHEMES, LogitBias, dense_bias

AUTO = "auto"  # the attention_impl that picks a backend per forward


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend.

    arrays(q, k, v, *, mask, bias, scale, is_causal, softcap): attention given the mask
      and the bias as arrays; None for a backend that reads only structure.
    rule(q, k, v, rule, bias, softcap): attention given the MaskRule and a LogitBias, read
      a block at a time; None for a backend that reads arrays (the rule's mask array is
      built for it, and the bias applied densely).
    by_index(q, k, v, bias, window, softcap): index-causal (and windowed) self-attention
      with no mask array, for rules by index with nothing packed or padded (cuDNN's fast
      path); None where the backend has no such form. (softcap, each function's keyword:
      the logit soft-cap, passed only when there is one, to a backend with takes_softcap.)
    takes_bias: whether it adds a logit bias at all.
    contextual: it runs a contextual scheme (CoPE: whole rows of keys at once).
    takes_softcap: it applies a logit soft-cap (jax.nn.dot_product_attention has none).
    takes_sinks: it adds attention sinks to the softmax (keyword sinks [N], passed only
      when there are some; jax.nn.dot_product_attention and splash have none).
    takes_value_width: its values may be narrower or wider than its queries and keys
      (MLA: jax.nn.dot_product_attention and splash need them equal).
    over_cache: its rule function also runs over a KV cache's slots (a prefill; empty
      slots sit at EMPTY_SLOT, which the rule hides).
    splits_sequence: it runs with the sequence split over a mesh axis (context
      parallelism); auto picks such a backend exactly when the sequence is split.
    platforms: where it runs (jax.default_backend() names), None for everywhere.
    auto(setting) -> why `auto` picks it in this setting ('' to pick it silently), or
      None; exactly one entry answers for any setting.
    """

    arrays: Callable | None = None
    rule: Callable | None = None
    by_index: Callable | None = None
    takes_bias: bool = True
    contextual: bool = False
    takes_softcap: bool = False
    takes_sinks: bool = False
    takes_value_width: bool = False
    over_cache: bool = False
    splits_sequence: bool = False
    platforms: tuple[str, ...] | None = None
    auto: Callable[[Setting], str | None] | None = None


# ---- the backends' functions ---------------------------------------------------------

def _reference(q, k, v, *, mask, bias, scale, is_causal, softcap=None, sinks=None):
    if is_causal:
        mask = and_causal(mask, q.shape[1])
    return reference_attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap,
                               sinks=sinks)


def _fused(implementation: str, bias_as_q: bool = False):
    """jax.nn.dot_product_attention (XLA, or cuDNN flash attention on GPU); bias_as_q:
    the bias is handed over in the dtype of q (cuDNN takes it so).

    Its masked rows average over all keys; rows with no allowed key are set to zero here so
    that every backend answers like the reference. It has no logit soft-cap (no
    takes_softcap: the dispatch never hands it one)."""
    def call(q, k, v, mask, bias, scale, **structure):
        if bias is not None and bias_as_q:
            bias = bias.astype(q.dtype)
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                           implementation=implementation, **structure)
        if mask is not None:
            any_key = jnp.any(mask, axis=-1)  # [B, 1|N, T]
            out = out * jnp.swapaxes(any_key, 1, 2)[..., None].astype(out.dtype)
        return out

    def arrays(q, k, v, *, mask, bias, scale, is_causal):
        return call(q, k, v, and_causal(mask, q.shape[1]) if is_causal else mask, bias, scale)

    def by_index(q, k, v, bias, window):  # is_causal, local_window_size: no mask array
        return call(q, k, v, None, bias, None, is_causal=True,
                    local_window_size=None if window is None else (window - 1, 0))

    return arrays, by_index


def _blockwise_arrays(q, k, v, *, mask, bias, scale, is_causal, softcap=None, sinks=None):
    """Blockwise attention for masks and biases given as arrays: their positions are
    indices, and the mask joins the bias as -inf (the model passes structure instead)."""
    b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    index = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))  # noqa: E731
    terms = None if bias is None else bias.astype(jnp.float32)
    if mask is not None:
        hide = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
        terms = hide if terms is None else terms + hide
    rule = MaskRule(index(tq), index(tk), causal=False, is_causal=is_causal)
    return blockwise_attention(q, k, v, rule, bias_fn=None if terms is None else index_bias,
                               bias_params=terms, scale=scale, softcap=softcap, sinks=sinks)


def _blockwise_rule(q, k, v, rule, bias, softcap=None, sinks=None):
    return blockwise_attention(q, k, v, rule, bias_fn=None if bias is None else bias.fn,
                               bias_params=None if bias is None else bias.params,
                               softcap=softcap, sinks=sinks)


def _splash_rule(q, k, v, rule, bias, softcap=None):
    return splash_attention(q, k, v, rule, softcap=softcap)


def _context_rule(gather: bool):
    """Context parallel attention (jaxformer.attention.ring), by ring or over gathered keys; with the
    sequence on one device, blockwise attention (a ring of one)."""
    def rule_fn(q, k, v, rule, bias, softcap=None, sinks=None):
        split = sequence_split()
        if split is None:
            return _blockwise_rule(q, k, v, rule, bias, softcap, sinks)
        return context_attention(q, k, v, rule, bias, split=split, gather=gather,
                                 softcap=softcap, sinks=sinks)
    return rule_fn



_xla, _xla_by_index = _fused("xla")
_cudnn, _cudnn_by_index = _fused("cudnn", bias_as_q=True)

BACKENDS: dict[str, Backend] = {
    "reference": Backend(arrays=_reference, takes_softcap=True, takes_sinks=True, contextual=True,
                         takes_value_width=True, auto=rules.reference),
    "xla": Backend(arrays=_xla, by_index=_xla_by_index, auto=rules.xla),
    "cudnn": Backend(arrays=_cudnn, by_index=_cudnn_by_index, platforms=("gpu",),
                     auto=rules.cudnn),
    "chunked": Backend(arrays=chunked_attention,  # fastest on XLA:CPU, forward and backward
                       takes_softcap=True, takes_sinks=True, takes_value_width=True,
                       auto=rules.chunked),
    "blockwise": Backend(arrays=_blockwise_arrays, rule=_blockwise_rule, over_cache=True,
                         takes_softcap=True, takes_sinks=True, takes_value_width=True,
                         auto=rules.blockwise),
    "ring": Backend(rule=_context_rule(gather=False), takes_softcap=True, takes_sinks=True,
                    takes_value_width=True, splits_sequence=True,
                    auto=rules.context(gather=False)),
    "all_gather": Backend(rule=_context_rule(gather=True), takes_softcap=True, takes_sinks=True,
                          takes_value_width=True, splits_sequence=True,
                          auto=rules.context(gather=True)),
    "splash": Backend(rule=_splash_rule, takes_bias=False, takes_softcap=True, auto=rules.splash),
}


# ---- choosing and dispatching -------------------------------------------------------

_EXPLAINED: set = set()


def dense_logits_bytes(batch: int, heads: int, q_len: int, k_len: int) -> int:
    """One layer's dense float32 logits [B, N, Tq, Tk], in bytes: what `auto` budgets."""
    return 4 * batch * heads * q_len * k_len


# what a forward may ask of its backend beyond plain attention: the Backend flag that
# grants it, and how a backend without it is refused
NEEDS = {"softcap": ("takes_softcap", "takes no logit softcap"),
         "sinks": ("takes_sinks", "takes no attention sinks"),
         "value_width": ("takes_value_width", "needs values as wide as the keys")}


def takers(flag: str) -> list[str]:
    """The backends whose Backend `flag` is set (e.g. takes_sinks), in table order."""
    return [n for n, b in BACKENDS.items() if getattr(b, flag)]


def softcap_backends() -> list[str]:
    """The backends that apply a logit soft-cap, in table order."""
    return takers("takes_softcap")


def sink_backends() -> list[str]:
    """The backends that take attention sinks, in table order."""
    return takers("takes_sinks")


def resolve_impl(impl: str, dtype, head_dim: int, logits_bytes: int = 0,
                 position: str | None = None, softcap: bool = False,
                 window_as_data: bool = False, context: int = 1, kv_bytes: int = 0,
                 sinks: bool = False, value_width: bool = False) -> str:
    """`impl`, or for `auto` the backend whose entry answers for this platform, position
    scheme and length (logits_bytes: one layer's dense float32 logits); its reason is
    printed once per process. softcap: the logits are soft-capped; an `impl` that takes
    no softcap raises, and `auto` picks only a backend that takes one. window_as_data:
    the scanned layers' windows differ (see Setting). context, kv_bytes: the devices the
    sequence is split over, one layer's K/V bytes (auto picks a backend that splits the
    sequence exactly when context > 1). sinks: the softmax has attention sinks;
    value_width: the values' width differs from the keys' (MLA); each as softcap."""
    if impl != AUTO and impl not in BACKENDS:
        raise ValueError(f"attention impl={impl!r} is not one of "
                         f"{', '.join([AUTO, *BACKENDS])}")
    needs = [n for n, on in (("softcap", softcap), ("sinks", sinks),
                             ("value_width", value_width)) if on]
    if impl != AUTO:
        if scheme_kind(position) == "contextual" and not BACKENDS[impl].contextual:
            raise ValueError(contextual_refusal(impl, position))
        for need in needs:
            flag, refusal = NEEDS[need]
            if not getattr(BACKENDS[impl], flag):
                raise ValueError(f"attention impl={impl!r} {refusal}; use one of "
                                 f"{', '.join([AUTO, *takers(flag)])}")
        return impl
    setting = Setting(jax.default_backend(), dtype, head_dim, position, logits_bytes,
                      softcap=bool(softcap), window_as_data=window_as_data, context=context,
                      kv_bytes=kv_bytes, sinks=bool(sinks), value_width=bool(value_width))
    for name, backend in BACKENDS.items():
        if backend.splits_sequence != (context > 1):
            continue
        if any(not getattr(backend, NEEDS[n][0]) for n in needs) or \
                (setting.contextual and not backend.contextual):
            continue  # the table's rules never answer so; this is the guard
        reason = None if backend.auto is None else backend.auto(setting)
        if reason is not None:
            if reason and (name, reason) not in _EXPLAINED:
                _EXPLAINED.add((name, reason))
                print(f"attention: auto chose {name}: {reason}", file=sys.stderr, flush=True)
            return name
    raise ValueError(f"no attention backend answers for {setting}")


def check_model(cfg) -> None:
    """What a model (a ModelConfig) asks of its named attention_impl that the backend
    cannot do: a logit bias, a contextual scheme, a soft-cap, sinks, values of another
    width than the keys (MLA). One ConfigError line naming the backends that can."""
    backend = BACKENDS.get(cfg.attention_impl)
    if backend is None:  # auto picks one that can
        return
    kind = scheme_kind(cfg.position)
    impl = f"model.attention_impl={cfg.attention_impl!r}"
    if kind == "bias" and not backend.takes_bias:
        by_rule = [n for n, b in BACKENDS.items() if b.takes_bias and b.rule is not None]
        raise ConfigError(
            f"{impl} adds no bias to the logits, so position={cfg.position!r} cannot use it; "
            f"use attention_impl={' or '.join(map(repr, by_rule))} (or {AUTO!r}), or "
            f"{'/'.join(n for n, s in POSITION_SCHEMES.items() if s.kind != 'bias')} positions")
    if kind == "contextual" and not backend.contextual:
        raise ConfigError("model." + contextual_refusal(cfg.attention_impl, cfg.position))
    for needed, takes, what in (
            (cfg.attn_softcap is not None, "takes_softcap",
             f"cannot soft-cap the logits (model.attn_softcap={cfg.attn_softcap})"),
            (cfg.attn_sinks, "takes_sinks", "has no attention sinks (model.attn_sinks)"),
            (cfg.mla.on, "takes_value_width", "needs values as wide as the keys, and MLA's "
             f"are {cfg.mla.v_head_dim} against {cfg.mla.qk_head_dim} (model.mla)")):
        if needed and not getattr(backend, takes):
            raise ConfigError(f"{impl} {what}; use one of {', '.join(takers(takes))} or {AUTO!r}")


def contextual_refusal(impl: str, position: str) -> str:
    """Why backend `impl` cannot run contextual scheme `position`, and what can."""
    return (f"attention_impl={impl!r} cannot run position={position!r}: a key's position sums "
            f"gates over the query's whole row of keys, which {impl} never holds at once; use "
            f"attention_impl={' or '.join(repr(n) for n, b in BACKENDS.items() if b.contextual)}"
            f" or {AUTO!r}")


def takes_structure(impl: str, t: int, cached: bool) -> bool:
    """Whether attention over t queries runs a backend that reads the MaskRule and the
    LogitBias a block at a time; with a KV cache only a prefill does (T > 1): a decode
    step's [B, N, 1, S] is small, and cached attention is faster for it."""
    return BACKENDS[impl].rule is not None and (not cached or t > 1)


def backends_here(platform: str | None = None) -> list[str]:
    """The backends that run on `platform` (default: jax's), in table order."""
    platform = platform or jax.default_backend()
    return [n for n, b in BACKENDS.items() if b.platforms is None or platform in b.platforms]


def prefill_impl(impl: str) -> str:
    """The backend a KV-cached prefill runs when `impl` reads rules: `impl` itself if it
    runs over a cache's slots, else the first that does (splash's prefill runs blockwise)."""
    if BACKENDS[impl].over_cache:
        return impl
    return next(name for name, b in BACKENDS.items() if b.over_cache and b.takes_bias)


def rule_attention(q, k, v, rule: MaskRule, bias=None, *, impl: str = AUTO, softcap=None,
                   sinks=None):
    """Attention of q [B, T, N, H] over k, v [B, S, K, H] with the mask given as a rule
    (the model's path). A backend that reads rules gets the rule and the LogitBias; one
    with a by-index form gets is_causal and the window with no mask array when the rule
    is by index and nothing is packed or padded; otherwise the rule's mask array.
    bias: a LogitBias, an array [B|1, N|1, T, S], or None. softcap: the scaled logits s
    become softcap * tanh(s / softcap) before the bias and the mask (None: no cap); an
    impl that takes none raises ValueError. sinks: [N] attention sinks, or None; likewise."""
    softcap = check_softcap(softcap)
    impl = resolve_impl(impl, q.dtype, q.shape[-1], logits_bytes=dense_logits_bytes(
        q.shape[0], q.shape[2], q.shape[1], k.shape[1]), softcap=softcap is not None,
        sinks=sinks is not None, value_width=v.shape[-1] != q.shape[-1])
    backend = BACKENDS[impl]
    if backend.rule is not None:
        if bias is not None and not isinstance(bias, LogitBias):
            raise ValueError(f"attention_impl={impl!r} takes the bias as a LogitBias "
                             "(jaxformer.positions.schemes.PositionBias), not an array")
        if bias is not None and not backend.takes_bias:
            raise ValueError(f"attention_impl={impl!r} adds no logit bias; use one of "
                             f"{', '.join(n for n, b in BACKENDS.items() if b.takes_bias)}")
        return backend.rule(q, k, v, rule, bias, **_extras(softcap, sinks))
    if isinstance(bias, LogitBias):
        bias = dense_bias(bias, rule.q_positions, rule.k_positions)
    causal = rule.causal or rule.is_causal
    if backend.by_index is not None and rule.by_index and causal and rule.q_segment_ids is None:
        return backend.by_index(q, k, v, as_4d(bias), rule.window, **_extras(softcap, sinks))
    return dot_product_attention(q, k, v, mask=rule.dense(), bias=bias, impl=impl,
                                 is_causal=rule.is_causal, softcap=softcap, sinks=sinks)


def dot_product_attention(q, k, v, *, mask=None, bias=None, impl: str = AUTO, scale=None,
                          is_causal: bool = False, softcap=None, sinks=None):
    """softmax(q k^T / sqrt(head_dim) + bias, where mask) v.

    q: [B, Tq, N, H]; k, v: [B, Tk, K, H] with N a multiple of K (GQA; K = 1 is MQA).
    mask: bool, broadcastable to [B, N, Tq, Tk] with a size-1 or full head axis.
    bias: float, same broadcasting. is_causal: also hide every key after the query's own
    index (self-attention, Tq = Tk), which lets the chunked backend skip that work.
    Softmax runs in float32 whatever the input dtype; a query with no key to attend to
    gets a zero output. Returns [B, Tq, N, H] in q.dtype. impl: a BACKENDS name or auto.
    softcap: Gemma 2's logit soft-capping, s = q k^T * scale -> softcap * tanh(s / softcap)
    before the bias and the mask; None (default) for none. Only backends with
    takes_softcap apply it: another named in impl raises ValueError, and auto picks one.
    sinks: attention sinks [N] (gpt-oss: a logit per query head in every row's softmax, a
    key with a zero value), or None; only backends with takes_sinks take them, likewise.
    """
    softcap = check_softcap(softcap)
    impl = resolve_impl(impl, q.dtype, q.shape[-1], softcap=softcap is not None,
                        sinks=sinks is not None, value_width=v.shape[-1] != q.shape[-1])
    if is_causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"is_causal needs as many keys as queries, got {q.shape[1]} queries "
                         f"and {k.shape[1]} keys")
    if BACKENDS[impl].arrays is None:
        raise ValueError(f"{impl} takes the mask as structure, not arrays: set the model's "
                         f"attention_impl={impl!r}, or call jaxformer.attention.backends.rule_attention "
                         "with a MaskRule")
    return BACKENDS[impl].arrays(q, k, v, mask=as_4d(mask), bias=as_4d(bias), scale=scale,
                                 is_causal=is_causal, **_extras(softcap, sinks))


def _extras(softcap, sinks) -> dict:
    """The softcap and sinks keywords for a backend's function: only those there are."""
    return {k: x for k, x in (("softcap", softcap), ("sinks", sinks)) if x is not None}
