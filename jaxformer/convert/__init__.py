"""Hugging Face interop: load and save checkpoints of every model type in
jaxformer.hf.families (GPT-2, GPT-NeoX, and the Llama layout's lineage: Llama 2/3,
Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2/3, ...).

    from jaxformer.convert import from_hf, to_hf
    cfg, params = from_hf("path/to/hf_model")          # config.json + safetensors
    logits = Transformer(cfg).apply({"params": params}, tokens)
    to_hf(cfg, params, "path/to/out")                  # transformers.from_pretrained reads it

    python -m jaxformer.convert from-hf HF_DIR RUN_DIR [section.key=value ...]
    python -m jaxformer.convert to-hf RUN_DIR HF_DIR

Only local folders and safetensors files are read (no download, no pickle). A config
option or tensor that jaxformer cannot express exactly is an error that names it.

Reading a folder is jaxformer.hf's, below training (train.init_from starts runs from HF
folders); this package writes them (to_hf, PEFT adapters) and holds the CLI, which makes
and reads training runs, so it sits above training.
"""

from jaxformer.convert.hf import to_hf
from jaxformer.convert.hf_config import config_to_hf
from jaxformer.hf import (MODEL_TYPES, SafetensorsReader, config_from_hf, from_hf,
                          generation_constraints, read_hf_config, read_hf_json)
from jaxformer.hf.tensors import permute_half_to_interleaved, permute_interleaved_to_half

__all__ = [
    "MODEL_TYPES",
    "SafetensorsReader",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "generation_constraints",
    "permute_half_to_interleaved",
    "permute_interleaved_to_half",
    "read_hf_config",
    "read_hf_json",
    "to_hf",
]
