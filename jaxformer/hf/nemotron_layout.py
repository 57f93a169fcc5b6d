"""NVIDIA's Nemotron-H and IBM's Granite 4 (granitemoehybrid): Mamba-2 layers beside attention (and MLP or MoE layers): their config.json readers and writers and tensor rules, and their rows."""

from __future__ import annotations

ROWS: list = []  # HFModelType rows (jaxformer.hf.model_type)
