"""Hugging Face config.json -> ModelConfig: the model type's row (jaxformer.hf.families)
reads it, a key absent from the file taking the row's default.

Every field that changes what the model computes is read explicitly; a value jaxformer
cannot express exactly is a ConfigError naming the key, never a guess.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxformer.hf.families import MODEL_TYPES, OTHER_MODEL_TYPES, HFModelType
from jaxformer.model.config import ConfigError, ModelConfig

_REQUIRED = object()  # a key without a default


def model_type_row(hf: Mapping[str, Any]) -> HFModelType:
    """The row of a config.json's model_type, after checking its architectures."""
    model_type = hf.get("model_type")
    archs = list(hf.get("architectures") or [])
    if model_type not in MODEL_TYPES:
        other = (f": {OTHER_MODEL_TYPES[model_type]}," if model_type in OTHER_MODEL_TYPES
                 else "")
        raise ConfigError(f"unsupported model_type {model_type!r}{other} (architectures "
                          f"{archs}); supported model types are: {', '.join(MODEL_TYPES)}")
    row = MODEL_TYPES[model_type]
    bad = [a for a in archs if a not in row.architectures]
    if bad:
        raise ConfigError(f"unsupported architecture(s) {', '.join(bad)} for model_type "
                          f"{model_type!r}; supported: {', '.join(row.architectures)}")
    return row


def key_reader(hf: Mapping[str, Any], row: HFModelType) -> Callable:
    """get(key, default): hf[key], else the row's default, else `default`; a key with none
    of them is an error naming it."""
    def get(key, default=_REQUIRED):
        if key in hf:
            return hf[key]
        default = row.defaults.get(key, default)
        if default is _REQUIRED:
            raise ConfigError(f"config.json has no {key!r}, which a {row.name} model needs")
        return default

    return get


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a parsed mapping)."""
    row = model_type_row(hf)
    return row.read_config(hf, key_reader(hf, row), row)
