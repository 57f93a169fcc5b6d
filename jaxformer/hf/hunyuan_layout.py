"""Hunyuan (hunyuan_v1_dense, hunyuan_v1_moe): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
