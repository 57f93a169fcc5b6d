"""Multimodal folders whose text model is a supported family: their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
