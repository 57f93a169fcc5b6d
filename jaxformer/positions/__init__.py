"""Positional encodings: the math as plain functions of arrays (formulas), the table of
schemes a model chooses from with model.position (schemes: POSITION_SCHEMES), CoPE's
contextual positions (cope) and the RoPE frequency scalings (rope_scaling).

The formulas are re-exported here: ``from jaxformer.positions import apply_rope``."""

from jaxformer.positions.formulas import (FIRE_EPS, FIRE_THRESHOLD, KERPLE_EPS, XPOS_GAMMA,
                                          XPOS_MAX_POSITION, XPOS_SCALE_BASE, alibi_bias,
                                          alibi_slopes, apply_rope, fire_distance, kept_frequencies,
                                          kerple_bias, no_rope_tables, relative_position_bucket,
                                          rope_tables, rotary_dims, rotate, sandwich_bias,
                                          sandwich_slopes, segment_positions, sinusoidal, t5_bias,
                                          xpos_scale)
from jaxformer.positions.rope_scaling import RopeScaling, rope_frequencies

__all__ = ["FIRE_EPS", "FIRE_THRESHOLD", "KERPLE_EPS", "XPOS_GAMMA", "XPOS_MAX_POSITION",
           "XPOS_SCALE_BASE", "RopeScaling", "alibi_bias", "alibi_slopes", "apply_rope",
           "fire_distance", "kept_frequencies", "kerple_bias", "no_rope_tables",
           "relative_position_bucket", "rope_frequencies", "rope_tables", "rotary_dims",
           "rotate", "sandwich_bias", "sandwich_slopes", "segment_positions", "sinusoidal",
           "t5_bias", "xpos_scale"]
