"""The positional schemes as a table: one PositionScheme per `model.position`, saying
where the scheme acts and with what math (jaxformer.positions.formulas). Config validation, the
model, the attention backends and the studies read it; a new scheme is one entry
(``POSITION_SCHEMES[name] = PositionScheme(...)``) plus its math, and the property tests
parametrised over the table test it.

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
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.sharding import init_with_names
from jaxformer.core.validation import ConfigError
from jaxformer.positions.cope import cope_logits
from jaxformer.positions.formulas import (FIRE_THRESHOLD, XPOS_MAX_POSITION, alibi_bias,
                                          alibi_slopes, fire_distance, kerple_bias, no_rope_tables,
                                          rope_tables, rotary_dims, rotate, sandwich_bias,
                                          sandwich_slopes, sinusoidal, t5_bias, xpos_scale)

KINDS = ("absolute", "rotary", "bias", "contextual", "none")


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
class PositionScheme:
    """One positional scheme (see the module docstring for the kinds).

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
    causal_only: defined for causal attention only, so an encoder (model.arch=encoder)
      refuses it (in `checked`): xPos (its scales decay only for keys behind the query,
      and grow ahead), CoPE (a key's position counts gates from it to the end of the row).
    """

    kind: str
    embed: Callable | None = None
    rotate: Callable | None = None
    bias: Callable | None = None
    logits: Callable | None = None
    max_length: Callable | None = None
    check: Callable | None = None
    causal_only: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"PositionScheme kind={self.kind!r} is not one of {', '.join(KINDS)}")
        needs = {"absolute": "embed", "rotary": "rotate", "bias": "bias",
                 "contextual": "logits"}.get(self.kind)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"a PositionScheme of kind {self.kind!r} needs `{needs}`")

    def checked(self, cfg) -> None:
        """What this scheme refuses of model config `cfg`: its own check, and an arch without
        the causal rule where it is causal_only; one ConfigError line."""
        if self.check is not None:
            self.check(cfg)
        if self.causal_only and not cfg.causal:
            both = [n for n, s in POSITION_SCHEMES.items() if not s.causal_only]
            raise ConfigError(f"model.position={cfg.position!r} is defined for causal attention "
                              f"only, not model.arch={cfg.arch!r}; use one of {', '.join(both)}")


# ---- absolute ------------------------------------------------------------------------

# model.sinusoidal_scale: (the table / sqrt(d_model), the tokens * sqrt(d_model))
SINUSOIDAL_SCALES = {"table": (True, False), "tokens": (False, True), "unit": (False, False)}


def sinusoidal_terms(cfg, x, positions):
    """Token embeddings x [B, T, D] and the sinusoidal table, scaled as
    cfg.sinusoidal_scale says; the input is their sum."""
    table = sinusoidal(positions, cfg.d_model, dtype=jnp.float32)
    root = jnp.float32(np.sqrt(cfg.d_model))
    shrink_table, grow_tokens = SINUSOIDAL_SCALES[cfg.sinusoidal_scale]
    if shrink_table:
        table = table / root
    if grow_tokens:
        x = x * root.astype(x.dtype)
    return x, table.astype(x.dtype)


def _sinusoidal(module, cfg, x, positions):
    return sinusoidal_terms(cfg, x, positions)


def _learned(module, cfg, x, positions):
    table = nn.Embed(cfg.max_seq_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=init_with_names(nn.initializers.normal(0.01), "table",
                                                    "embed"), name="pos_embed")
    return x, table(positions)


def _even(field: str, why: str):
    def check(cfg):
        if getattr(cfg, field) % 2:
            raise ConfigError(f"model.{field}={getattr(cfg, field)} is odd; {why}")
    return check


# ---- rotary --------------------------------------------------------------------------

def _rotary(xpos: bool):
    """RoPE (xpos False) or xPos (Sun et al. 2022: RoPE whose pairs also decay with
    distance, jaxformer.positions.formulas.xpos_scale) as a scheme's rotate."""
    def rotate_fn(cfg, x, positions, kind=0, keys=False):
        """x rotated with the base and scaling of layer kind `kind` (a NoPE kind: x as it
        is); keys: x holds keys (xPos scales them the other way). Traced inside a scan
        over layers, kind picks its tables among the kinds' own."""
        kinds, rot = cfg.kinds, rotary_dims(cfg.head_dim, cfg.rope_fraction)
        scale = xpos_scale(positions, rot, keys) if xpos else None

        def tables(k):
            if not k.rope:
                return no_rope_tables(positions, cfg.head_dim)
            return rope_tables(positions, cfg.head_dim, theta=k.rope_theta,
                               scaling=k.rope_scaling, fraction=cfg.rope_fraction,
                               p=cfg.p_rope, scale=scale)

        if not isinstance(kind, jax.Array):
            if not kinds[kind].rope:
                return x
            return rotate(x, *tables(kinds[kind]), rot)
        rotations = [(k.rope, k.rope_theta, k.rope_scaling) for k in kinds]
        distinct = list(dict.fromkeys(rotations))
        if len(distinct) == 1:
            cos, sin = tables(kinds[0])
        else:
            which = jnp.asarray([distinct.index(r) for r in rotations], jnp.int32)[kind]
            each = [tables(kinds[rotations.index(r)]) for r in distinct]
            cos, sin = (jnp.stack(t)[which] for t in zip(*each))  # [B, T, 1, H]
        return rotate(x, cos, sin, rot)
    return rotate_fn


def _check_xpos(cfg):
    _check_rope(cfg)
    if cfg.max_seq_len > XPOS_MAX_POSITION:
        raise ConfigError(f"model.max_seq_len={cfg.max_seq_len} is past {XPOS_MAX_POSITION}, "
                          "where xPos's per-position scales leave float32; use position=rope "
                          "(or a shorter max_seq_len)")


def _check_rope(cfg):
    rot = rotary_dims(cfg.head_dim, cfg.rope_fraction)
    if cfg.rope_fraction == 1:
        _even("head_dim", "RoPE rotates pairs of dimensions and needs an even head_dim")(cfg)
    elif rot % 2 or rot == 0:
        raise ConfigError(f"model.head_dim={cfg.head_dim} * model.rope_fraction="
                          f"{cfg.rope_fraction} = {rot} dimensions rotated; RoPE rotates pairs "
                          "and needs an even number > 0")


# ---- biases --------------------------------------------------------------------------

def _alibi(module, cfg):
    return LogitBias(alibi_bias, jnp.asarray(alibi_slopes(cfg.n_heads), jnp.float32))


@dataclasses.dataclass(frozen=True)
class _T5Bias:  # hashable by value: blockwise attention takes it as a static argument
    max_distance: int
    bidirectional: bool = False  # an encoder's buckets: half for keys after the query

    def __call__(self, table, q_positions, k_positions):
        return t5_bias(table, q_positions, k_positions, max_distance=self.max_distance,
                       bidirectional=self.bidirectional)


def _t5(module, cfg):
    table = module.param("relative_bias", init_with_names(nn.initializers.normal(0.02), "table",
                                                          "heads"),
                         (cfg.t5_num_buckets, cfg.n_heads), cfg.param_dtype)
    return LogitBias(_T5Bias(cfg.t5_max_distance, bidirectional=not cfg.causal), table)


@dataclasses.dataclass(frozen=True)
class _SandwichBias:  # hashable by value, as _T5Bias
    dims: int

    def __call__(self, slopes, q_positions, k_positions):
        return sandwich_bias(slopes, q_positions, k_positions, dims=self.dims)


def _sandwich(module, cfg):
    """Sandwich over head_dim dimensions (the d' of NeMo's implementation)."""
    return LogitBias(_SandwichBias(cfg.head_dim), jnp.asarray(sandwich_slopes(cfg.n_heads),
                                                              jnp.float32))


def _kerple(module, cfg):
    """KERPLE-log's r1 ~ U(0, 2) and r2 ~ U(0, 1) per head (the reference code's init)."""
    def uniform(high):
        return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, 0.0, high)
    param = lambda name, high: module.param(  # noqa: E731
        name, init_with_names(uniform(high), "heads"), (cfg.n_heads,), jnp.float32)
    return LogitBias(_kerple_bias, {"r1": param("r1", 2.0), "r2": param("r2", 1.0)})


def _kerple_bias(p, q_positions, k_positions):
    return kerple_bias(p["r1"], p["r2"], q_positions, k_positions)


FIRE_WIDTH = 32  # FIRE's hidden layer


def _fire(module, cfg):
    """FIRE's bias, with the reference code's settings: an MLP 1 -> 32 -> heads (ReLU),
    c initialised at 0.1, the threshold at FIRE_THRESHOLD (learned as a multiple of it)."""
    param = lambda name, init, shape, *names, dtype=cfg.param_dtype: module.param(  # noqa: E731
        name, init_with_names(init, *names), shape, dtype)
    return LogitBias(fire_bias, {
        "c": param("c", nn.initializers.constant(0.1), (), dtype=jnp.float32),
        "threshold_scale": param("threshold_scale", nn.initializers.ones, (), dtype=jnp.float32),
        "hidden_kernel": param("hidden_kernel", nn.initializers.normal(1.0), (FIRE_WIDTH,),
                               "pos_mlp"),
        "hidden_bias": param("hidden_bias", nn.initializers.zeros, (FIRE_WIDTH,), "pos_mlp"),
        "out_kernel": param("out_kernel", nn.initializers.lecun_normal(),
                            (FIRE_WIDTH, cfg.n_heads), "pos_mlp", "heads"),
        "out_bias": param("out_bias", nn.initializers.zeros, (cfg.n_heads,), "heads")})


def fire_bias(p, q_positions, k_positions):
    """FIRE's logit bias from its params `p`: [B, N, Tq, Tk] float32."""
    f32 = lambda name: p[name].astype(jnp.float32)  # noqa: E731
    x = fire_distance(q_positions, k_positions, p["c"],
                      jnp.abs(p["threshold_scale"] * FIRE_THRESHOLD))[..., None]
    h = nn.relu(x * f32("hidden_kernel") + f32("hidden_bias"))  # [B, T, S, W]
    return jnp.einsum("btsw,wn->bnts", h, f32("out_kernel")) + f32("out_bias")[:, None, None]


# ---- contextual ------------------------------------------------------------------------

def _cope(module, cfg):
    """CoPE's position embeddings [head_dim, cope_positions] for one layer, shared by its
    heads (the reference code's shape). Initialised N(0, 0.02), where the reference starts
    at zeros (a NoPE model until trained): so a fresh model already counts positions."""
    table = module.param("cope_embedding", init_with_names(nn.initializers.normal(0.02),
                                                           "head_dim", "table"),
                         (cfg.head_dim, cfg.cope_positions), cfg.param_dtype)
    return lambda q, k, mask: cope_logits(q, k, table, mask)


def _check_cope(cfg):
    if cfg.attn_softcap is not None:
        raise ConfigError(f"position='cope' with model.attn_softcap={cfg.attn_softcap}: "
                          "CoPE's gates read the raw logits, a cap has no defined place; "
                          "drop one of them")


# ---- the table -----------------------------------------------------------------------

POSITION_SCHEMES: dict[str, PositionScheme] = {
    "rope": PositionScheme("rotary", rotate=_rotary(xpos=False), check=_check_rope),
    "alibi": PositionScheme("bias", bias=_alibi),
    "sinusoidal": PositionScheme("absolute", embed=_sinusoidal, check=_even(
        "d_model", "sinusoidal positions pair sin and cos and need an even d_model")),
    "learned": PositionScheme("absolute", embed=_learned, max_length=lambda cfg: cfg.max_seq_len),
    "none": PositionScheme("none"),
    "t5": PositionScheme("bias", bias=_t5),
    "fire": PositionScheme("bias", bias=_fire),
    "xpos": PositionScheme("rotary", rotate=_rotary(xpos=True), check=_check_xpos,
                           causal_only=True),
    "kerple": PositionScheme("bias", bias=_kerple),
    "sandwich": PositionScheme("bias", bias=_sandwich),
    "cope": PositionScheme("contextual", logits=_cope, check=_check_cope, causal_only=True),
}


def schemes_of(kind: str) -> list[str]:
    """The names of the schemes of one kind, in table order."""
    return [name for name, s in POSITION_SCHEMES.items() if s.kind == kind]


class PositionBias(nn.Module):
    """The attention-logit bias of the position scheme as a LogitBias, shared by every
    layer (as T5 does), or None for a scheme without one.

    Keys may be cache slots: an empty slot's far-future position gives a finite bias that
    the mask then hides."""

    cfg: Any

    @nn.compact
    def __call__(self):
        make = POSITION_SCHEMES[self.cfg.position].bias
        return None if make is None else make(self, self.cfg)
