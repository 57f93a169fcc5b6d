"""ERNIE 4.5 (ernie4_5, ernie4_5_moe): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
