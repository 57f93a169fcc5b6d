"""The gated delta rule's hybrids (jaxformer.model.mixers.gated_delta): qwen3_next and qwen3_5: their config.json readers and writers and tensor rules, and their rows."""

from __future__ import annotations

ROWS: list = []  # HFModelType rows (jaxformer.hf.model_type)
