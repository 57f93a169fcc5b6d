"""The rotary schemes: RoPE and xPos (Sun et al. 2022: RoPE whose pairs also decay with
distance). Their settings are the model's RoPE fields (rope_theta, rope_scaling,
rope_fraction, p_rope), which the layer kinds override per kind and every Hugging Face row
reads, so they stay model fields rather than position_settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.core.validation import ConfigError
from jaxformer.positions.formulas import (XPOS_MAX_POSITION, no_rope_tables, rope_tables,
                                          rotary_dims, rotate, xpos_scale)
from jaxformer.positions.scheme import PositionScheme, even


def _rotary(xpos: bool):
    """RoPE (xpos False) or xPos (jaxformer.positions.formulas.xpos_scale) as a scheme's
    rotate."""
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


def _check_rope(cfg):
    rot = rotary_dims(cfg.head_dim, cfg.rope_fraction)
    if cfg.rope_fraction == 1:
        even("head_dim", "RoPE rotates pairs of dimensions and needs an even head_dim")(cfg)
    elif rot % 2 or rot == 0:
        raise ConfigError(f"model.head_dim={cfg.head_dim} * model.rope_fraction="
                          f"{cfg.rope_fraction} = {rot} dimensions rotated; RoPE rotates pairs "
                          "and needs an even number > 0")


def _check_xpos(cfg):
    _check_rope(cfg)
    if cfg.max_seq_len > XPOS_MAX_POSITION:
        raise ConfigError(f"model.max_seq_len={cfg.max_seq_len} is past {XPOS_MAX_POSITION}, "
                          "where xPos's per-position scales leave float32; use position=rope "
                          "(or a shorter max_seq_len)")


SCHEMES = (
    PositionScheme("rope", "rotary", rotate=_rotary(xpos=False), check=_check_rope),
    PositionScheme("xpos", "rotary", rotate=_rotary(xpos=True), check=_check_xpos,
                   causal_only=True),
)
