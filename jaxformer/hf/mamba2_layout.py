"""Mamba-2's families (jaxformer.model.mixers.mamba2): mamba2 and bamba, and the mixer's tensors the other Mamba-2 hybrids share: their config.json readers and writers and tensor rules, and their rows."""

from __future__ import annotations

ROWS: list = []  # HFModelType rows (jaxformer.hf.model_type)
