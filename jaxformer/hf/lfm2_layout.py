"""LFM2 (Liquid AI): gated short convolutions (jaxformer.model.mixers.short_conv) beside attention: their config.json readers and writers and tensor rules, and their rows."""

from __future__ import annotations

ROWS: list = []  # HFModelType rows (jaxformer.hf.model_type)
