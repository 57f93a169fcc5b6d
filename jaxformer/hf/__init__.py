"""Hugging Face's checkpoint format: one row per model_type (families.py), config.json ->
ModelConfig, the tensor layouts both ways, and reading a local model folder (from_hf).

Training reads HF folders (train.init_from) from here; writing one (to_hf), PEFT adapters
and the converter CLI are jaxformer.convert, which sits above training.
"""

from jaxformer.hf.config_json import config_from_hf
from jaxformer.hf.families import MODEL_TYPES
from jaxformer.hf.folder import SafetensorsReader, from_hf, read_hf_config, read_hf_json
from jaxformer.hf.generation import generation_constraints

__all__ = ["MODEL_TYPES", "SafetensorsReader", "config_from_hf", "from_hf",
           "generation_constraints", "read_hf_config", "read_hf_json"]
