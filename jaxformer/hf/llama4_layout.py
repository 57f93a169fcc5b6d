"""Llama 4's text model (llama4_text) and its multimodal folder: their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
