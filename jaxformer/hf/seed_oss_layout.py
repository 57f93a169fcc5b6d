"""Seed-OSS (seed_oss): their rows (jaxformer.hf.model_type.HFModelType)."""

ROWS: list = []  # HFModelType rows
