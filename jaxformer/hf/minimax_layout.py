"""MiniMax-M2 (minimax_m2): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
