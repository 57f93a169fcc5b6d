"""Apertus (apertus): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
