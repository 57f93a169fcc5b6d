"""train.init_from: a new run that starts from another model's weights, a Hugging Face
folder (any model type jaxformer.hf reads) or a jaxformer run (RUN, or RUN@STEP).

This module settles the config: the model section comes from the source; the run's own
model keys may change only how the model runs (RUNTIME: dtypes, scan_layers, remat,
attention_impl, dropout, a mixer's chunk length, the LoRA adapters, max_seq_len unless it
sizes a table);
anything else is an error naming the field. With the source's tokenizer.json that is the
default tokenizer. The weights are loaded by jaxformer.training.initial_weights.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

from jaxformer.core.validation import build_section, merge, read_config_file, type_names
from jaxformer.hf import read_hf_config
from jaxformer.model import lora
from jaxformer.model.config import NESTED
from jaxformer.model.config import RUNTIME as MODEL_RUNTIME
from jaxformer.model.config import ConfigError, ModelConfig
from jaxformer.model.mixers import changed_settings
from jaxformer.positions.schemes import POSITION_SCHEMES

# config.RUNTIME (how a model taken from weights may run), and its adapters and length
RUNTIME = MODEL_RUNTIME + ("lora", "max_seq_len")


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str                 # "hf" or "run"
    path: pathlib.Path
    step: int | None = None   # a run's checkpoint step (None: its latest)


def parse_source(spec: str) -> Source:
    """PATH -> an HF folder (config.json) or a run dir (config.yaml); RUN@STEP a run's step."""
    path, step = str(spec), None
    if "@" in path and not pathlib.Path(path).exists():
        path, _, s = path.rpartition("@")
        if not s.isdigit():
            raise ConfigError(f"train.init_from={spec!r}: the step after @ must be a number "
                              "(RUN_DIR@STEP)")
        step = int(s)
    p = pathlib.Path(path)
    if (p / "config.yaml").is_file():
        return Source("run", p, step)
    if (p / "config.json").is_file() and step is None:
        return Source("hf", p)
    raise FileNotFoundError(f"train.init_from={spec!r} is neither a Hugging Face model folder "
                            "(with config.json) nor a jaxformer run dir (with config.yaml)")


def source_config(src: Source) -> tuple[ModelConfig, str | None]:
    """The source's ModelConfig and its tokenizer.json (None if it has none)."""
    tok = src.path / "tokenizer.json"
    tok = str(tok) if tok.is_file() else None
    if src.kind == "hf":
        return read_hf_config(src.path), tok
    model = read_config_file(str(src.path / "config.yaml")).get("model") or {}
    return build_section(ModelConfig, model, "model", nested=NESTED), tok


def initial_sections(values: Mapping[str, Any]) -> dict:
    """The run's raw config sections with train.init_from's model (and tokenizer, unless
    data.tokenizer is set) filled in; a model key that would change the weights' meaning
    or shape is refused."""
    spec = (values.get("train") or {}).get("init_from")
    if not spec or set(type_names(ModelConfig)) <= set(values.get("model") or {}):
        return dict(values)  # no source, or a run's own config.yaml: the whole model is here
    try:
        src = parse_source(spec)
    except FileNotFoundError as e:  # its message names the spec and what it must hold
        raise ConfigError(str(e)) from None
    model, tok = source_config(src)
    theirs = model.replace(lora=lora.LoRAConfig()).to_dict()
    ours = dict(values.get("model") or {})
    if "preset" in ours:
        raise ConfigError(f"model.preset={ours['preset']} and train.init_from={spec} both give "
                          "the model; drop model.preset (the weights' model is used)")
    combined = build_section(ModelConfig, merge(theirs, ours), "model", nested=NESTED)
    allowed = RUNTIME
    if POSITION_SCHEMES[model.position].max_length is not None:  # a table, a row a position
        allowed = tuple(f for f in RUNTIME if f != "max_seq_len")
    changed = changed_settings(combined, model, allowed)
    if changed:
        names = [name for name, _, _ in changed]
        table = (f" (position={model.position!r}: a table of max_seq_len={model.max_seq_len} "
                 "rows)" if "max_seq_len" in names else "")
        raise ConfigError(
            f"model.{names[0]}={changed[0][1]!r} differs from {changed[0][2]!r} in "
            f"train.init_from={spec} ({', '.join('model.' + c for c in names)}); a run "
            f"started from weights may set only model.{', model.'.join(allowed)}{table}")
    out = {**values, "model": merge(theirs, ours)}
    if tok and "tokenizer" not in (values.get("data") or {}):
        out["data"] = {**(values.get("data") or {}), "tokenizer": tok}
    return out
