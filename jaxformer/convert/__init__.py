"""Hugging Face interop: load and save GPT-2, GPT-NeoX (sequential residual, full rotary)
and Llama-family (Llama 2/3, Mistral, Qwen2) checkpoints.

    from jaxformer.convert import from_hf, to_hf
    cfg, params = from_hf("path/to/hf_model")          # config.json + safetensors
    logits = Transformer(cfg).apply({"params": params}, tokens)
    to_hf(cfg, params, "path/to/out")                  # transformers.from_pretrained reads it

    python -m jaxformer.convert from-hf HF_DIR RUN_DIR [section.key=value ...]
    python -m jaxformer.convert to-hf RUN_DIR HF_DIR

Only local folders and safetensors files are read (no download, no pickle). A config
option or tensor that jaxformer cannot express exactly is an error that names it.
"""

from jaxformer.convert.hf import SafetensorsReader, from_hf, read_hf_config, read_hf_json, to_hf
from jaxformer.convert.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from jaxformer.convert.tensors import permute_half_to_interleaved, permute_interleaved_to_half

__all__ = [
    "ARCHITECTURES",
    "SafetensorsReader",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "permute_half_to_interleaved",
    "permute_interleaved_to_half",
    "read_hf_config",
    "read_hf_json",
    "to_hf",
]
