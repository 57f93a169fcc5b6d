"""One positional scheme as a value: PositionScheme (where it acts and with what math), its
settings class (PositionSettings: the scheme's own hyperparameters, model.position_settings),
and LogitBias (a bias scheme's bias as a pytree). The entries live beside their math, one
module per kind (absolute, rotary, biases, cope); jaxformer.positions.schemes gathers them.

Where a scheme acts (its kind):
- absolute: `embed` gives terms added to the token embeddings (sinusoidal, learned);
- rotary: `rotate` turns queries and keys (rope);
- bias: `bias` declares a logit bias shared by every layer (alibi, t5, fire), which dense
  backends apply to all (query, key) pairs once per forward and blockwise attention to
  each block;
- contextual: `logits` computes each layer's attention logits from q and k themselves
  (cope: a key's position counts gates over the row), so only a backend that reads whole
  rows of keys runs it (jaxformer.attention.backends, Backend.contextual);
- none: nothing (NoPE: the causal mask alone carries order).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import flax.struct

from jaxformer.core.validation import ConfigError, coerce, type_names

KINDS = ("absolute", "rotary", "bias", "contextual", "none")
OWNER = "model.position_settings"  # where a scheme's settings are written


@flax.struct.dataclass
class LogitBias:
    """A position scheme's logit bias as structure: fn(params, q_positions [B, Tq],
    k_positions [B, Tk]) -> float32 [B|1, N, Tq, Tk], and its params. A pytree: jit, scan,
    remat and vmap carry the params, and fn (hashable) travels in the treedef."""

    fn: Callable = flax.struct.field(pytree_node=False)
    params: Any = None


def dense_bias(bias: LogitBias | None, q_positions, k_positions):
    """The bias applied to every (query, key) pair: [B|1, N, Tq, Tk], or None."""
    return None if bias is None else bias.fn(bias.params, q_positions, k_positions)


@dataclasses.dataclass(frozen=True)
class PositionSettings:
    """A scheme's own hyperparameters (model.position_settings): a frozen dataclass whose
    subclasses add fields and check them alone in __post_init__ (one ConfigError line
    naming model.position_settings.<field>). The base has none (most schemes).

    LEGACY: the flat ModelConfig keys of earlier versions (model.t5_num_buckets) -> the
    field that now holds each; a saved run's config.yaml still carries them."""

    LEGACY: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def read(cls, value, position: str) -> "PositionSettings":
        """The settings of position `position` from None (the defaults), an instance, a
        mapping of field values (strings from the command line coerced; a key the scheme
        lacks refused), or another scheme's settings: a model replaced to another position
        (cfg.replace(position=...)) starts from the new scheme's defaults, as the old
        scheme's settings no longer apply."""
        if type(value) is cls:
            return value
        if value is None or isinstance(value, PositionSettings):
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{OWNER}={value!r} must be a mapping of position={position!r}'s "
                              f"settings ({', '.join(type_names(cls)) or 'it has none'})")
        fields = type_names(cls)
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(f"{OWNER}.{unknown[0]} is not a setting of position={position!r} "
                              f"({'its settings: ' + ', '.join(fields) if fields else 'it has none'})")
        return cls(**{k: coerce(v, fields[k], f"{OWNER}.{k}") for k, v in value.items()})


def even(field: str, why: str):
    """A scheme's check that model.<field> is even."""
    def check(cfg):
        if getattr(cfg, field) % 2:
            raise ConfigError(f"model.{field}={getattr(cfg, field)} is odd; {why}")
    return check


@dataclasses.dataclass(frozen=True)
class PositionScheme:
    """One positional scheme (see the module docstring for the kinds), named `name` (its
    model.position).

    embed(module, cfg, x [B, T, D], positions [B, T]) -> (x, terms [B, T, D]): the input
      is x + terms (terms hooked as hook_pos_embed); params are declared on `module`.
    rotate(cfg, x [B, T, N, H], positions [B, T], kind, keys) -> x rotated as layer kind
      `kind` (an index into cfg.kinds; traced in a scan) wants; keys: x holds keys, not
      queries (xPos scales the two the opposite way).
    bias(module, cfg) -> LogitBias, its params declared on `module`.
    logits(module, cfg) -> fn(q [B, T, N, H], k [B, S, K, H], mask bool [B|1, 1, T, S])
      -> float32 logits [B, K, G, T, S] (-inf where masked): one attention layer's, its
      params declared on `module` (the layer's Attention).
    max_length(cfg) -> the longest sequence the scheme can encode (a learned table's
      rows), or None for any length.
    check(cfg): raises ConfigError naming a model field the scheme cannot work with.
    settings: its PositionSettings class; cfg.position_settings is one of them.
    causal_only: defined for causal attention only, so an encoder (model.arch=encoder)
      refuses it: xPos (its scales decay only for keys behind the query, and grow ahead),
      CoPE (a key's position counts gates from it to the end of the row).
    """

    name: str
    kind: str
    embed: Callable | None = None
    rotate: Callable | None = None
    bias: Callable | None = None
    logits: Callable | None = None
    max_length: Callable | None = None
    check: Callable | None = None
    settings: type = PositionSettings
    causal_only: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"PositionScheme kind={self.kind!r} is not one of {', '.join(KINDS)}")
        needs = {"absolute": "embed", "rotary": "rotate", "bias": "bias",
                 "contextual": "logits"}.get(self.kind)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"a PositionScheme of kind {self.kind!r} needs `{needs}`")
        if not (isinstance(self.settings, type) and issubclass(self.settings, PositionSettings)):
            raise ValueError(f"PositionScheme {self.name!r}: settings must be a PositionSettings "
                             "subclass")
