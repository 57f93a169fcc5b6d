"""GLM-4 and GLM-4.5 (glm4, glm4_moe): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
