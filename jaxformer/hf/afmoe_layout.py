"""Arcee's AFMoE (afmoe): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
