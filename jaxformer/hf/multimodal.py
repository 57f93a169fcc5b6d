"""Multimodal folders whose text model is a family jaxformer reads: their rows, and how
their text model is found (jaxformer.hf.model_type.HFModelType rows).

A multimodal folder's config.json nests its language model's keys under text_config, whose
model_type picks the text row that reads them (as transformers' AutoModel.from_config
does; the config class's default text model when it names none); the top level says
whether the head is tied (transformers ties by the model's own key). Its tensors are the
text row's under the folder's names (text_prefix for the language model, head for the LM
head) beside the parts jaxformer does not run (the vision tower, the projector), which are
skipped with one line on stderr. A text model_type jaxformer does not read is one
ConfigError line naming it.

Gemma 3 and Mistral 3 folders hold transformers' LLaVA names (language_model.model.*,
language_model.lm_head.weight, vision_tower.*, multi_modal_projector.*, as save_pretrained
writes them); Qwen3-VL's and Qwen3.5's, model.language_model.*, lm_head.weight and
model.visual.*. Text alone has the same position in each of Qwen3-VL's MRoPE sections, so
its text model (qwen3_vl_text) is Qwen3 with plain RoPE.

A multimodal row's arch is none of jaxformer's, so to_hf never writes one: a model read
from such a folder is written as a text-only folder by its text row, or (to_hf's `into`)
its text model's tensors go back into a copy of the folder (text_row names them there).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Callable, Mapping

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.model.config import ConfigError, ModelConfig

LLAVA = dict(text_prefix="language_model.model.", head="language_model.lm_head.weight",
             skipped={"vision tower": "vision_tower.", "projector": "multi_modal_projector."})
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # equal positions for text: plain RoPE


@dataclasses.dataclass(frozen=True)
class MultimodalType(HFModelType):
    """A multimodal folder's row (HFModelType's fields, and): text_type, the text model's
    model_type when text_config names none; skipped, {part: its tensors' name prefix};
    head_ignores, the text_config keys the multimodal model's head does not apply (read
    as None); tie_at_top, the head ties as the top level's tie_word_embeddings says (the
    multimodal model's own head), else as text_config's (the text model's own head, as
    Llama 4's). tensor_prefix and head_tensor: where the text model's tensors are."""

    text_type: str = ""
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
    head_ignores: tuple[str, ...] = ()
    tie_at_top: bool = True


def multimodal_row(name: str, architecture: str, export_rank: int, text_type: str, *,
                   text_prefix: str = "model.language_model.", head: str = "lm_head.weight",
                   skipped: Mapping[str, str], tie: bool = False, tie_at_top: bool = True,
                   head_ignores: tuple[str, ...] = ()) -> MultimodalType:
    """The row of a multimodal folder: model_type `name`, its architecture, its text
    model's default model_type (`text_type`), the text model's tensor names (text_prefix,
    head), the parts skipped ({words: tensor name prefix}), its tie_word_embeddings
    default (`tie`) and where the tie is read (MultimodalType), the text keys its head
    ignores."""
    return MultimodalType(
        name, (architecture,), export_rank=export_rank,
        defaults=dict(tie_word_embeddings=tie), read_config=read_config,
        tensor_rules=_through_text_row, tensor_prefix=text_prefix, head_tensor=head,
        ignored_tensors=tuple(re.escape(p) + ".*" for p in skipped.values()),
        arch="vision_language", text_type=text_type, skipped=dict(skipped),
        head_ignores=head_ignores, tie_at_top=tie_at_top)


def _through_text_row(cfg, row, rope_layout="half"):
    """A multimodal row's tensor_rules: none of its own (text_row has the folder's)."""
    raise TypeError(f"a {row.name} folder's tensors are its text model's: read them with "
                    "jaxformer.hf.multimodal.text_row(hf, row)")


# ---- the text model ---------------------------------------------------------------------


def _text_keys(hf: Mapping[str, Any], row: MultimodalType) -> dict[str, Any]:
    """text_config, the keys the multimodal model's head ignores set to None."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json has no text_config object: a {row.name!r} folder "
                          f"keeps its text model's keys there (a {row.text_type} model), "
                          "beside its vision tower's (vision_config)")
    return dict(text, **{key: None for key in row.head_ignores if key in text})


def text_row(hf: Mapping[str, Any], row: MultimodalType) -> HFModelType:
    """The row that reads a multimodal folder's text model: text_config's model_type's,
    its tensors under the folder's names, the skipped parts' tensors ignored."""
    from jaxformer.hf import MODEL_TYPES  # the text rows, looked up as the folder is read

    name = _text_keys(hf, row).get("model_type", row.text_type)
    text = MODEL_TYPES.get(name)
    if text is None or isinstance(text, MultimodalType):
        raise ConfigError(f"the {row.name} folder's text model has model_type {name!r} "
                          "(text_config.model_type), which jaxformer does not read; its "
                          "text models may be any of: "
                          + ", ".join(n for n, r in MODEL_TYPES.items()
                                      if not isinstance(r, MultimodalType)))
    return dataclasses.replace(text, tensor_prefix=row.tensor_prefix,
                               head_tensor=row.head_tensor,
                               ignored_tensors=text.ignored_tensors + row.ignored_tensors)


def folder_row(hf: Mapping[str, Any], row: HFModelType) -> HFModelType:
    """The row that reads a folder's tensors: a multimodal folder's text_row, else `row`."""
    return text_row(hf, row) if isinstance(row, MultimodalType) else row


def text_config(hf: Mapping[str, Any], row: MultimodalType) -> ModelConfig:
    """The ModelConfig of a multimodal folder's text model (text_config read by its text
    row, the head tied as the top level says, where the row's head is its own)."""
    text, trow = _text_keys(hf, row), text_row(hf, row)

    def get(key, *default):  # a text_config key, else the text row's default
        if key in text:
            return text[key]
        if key in trow.defaults or default:
            return trow.defaults.get(key, *default)
        raise ConfigError(f"config.json has no text_config.{key}, which a {trow.name} text "
                          "model needs")
    cfg = trow.read_config(text, get, trow)
    if row.tie_at_top:
        tie = hf.get("tie_word_embeddings", row.defaults["tie_word_embeddings"])
        cfg = cfg.replace(tie_embeddings=bool(tie))
    return cfg


def read_config(hf, get, row: MultimodalType) -> ModelConfig:
    """A multimodal row's read_config: text_config, with one line on stderr naming what
    is skipped."""
    cfg = text_config(hf, row)
    parts = " and ".join(f"{part} ({prefix}*)" for part, prefix in row.skipped.items())
    print(f"from_hf: {row.name} ({', '.join(hf.get('architectures') or [])}): skipping its "
          f"{parts}; jaxformer reads the text model alone ({text_row(hf, row).name})",
          file=sys.stderr, flush=True)
    return cfg


def plain_rope(read: Callable) -> Callable:
    """A read_config that reads rope_parameters without the MRoPE keys (text alone has the
    same position in each section: MRoPE is RoPE)."""
    def read_config(hf, get, row) -> ModelConfig:
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and set(MROPE_KEYS) & set(params):
            hf = dict(hf, rope_parameters={k: v for k, v in params.items()
                                           if k not in MROPE_KEYS})
        return read(hf, get, row)
    return read_config


# ---- the rows ---------------------------------------------------------------------------

ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    HFModelType(
        # Qwen3-VL's text model (Qwen3VLTextModel): Qwen3 without windows, its interleaved
        # MRoPE plain RoPE for text
        "qwen3_vl_text", ("Qwen3VLTextModel",), export_rank=62,
        defaults=dict(num_key_value_heads=32, hidden_act="silu", head_dim=128,
                      max_position_embeddings=128000, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attention_bias=False, rope_theta=500000.0),
        read_config=plain_rope(llama_layout.read_config), qk_norm="head", biases="attention"),
    multimodal_row("gemma3", "Gemma3ForConditionalGeneration", 63, "gemma3_text", tie=True,
                   head_ignores=("final_logit_softcapping",), **LLAVA),
    multimodal_row("qwen3_vl", "Qwen3VLForConditionalGeneration", 64, "qwen3_vl_text",
                   skipped={"vision tower": "model.visual."}),
    multimodal_row("mistral3", "Mistral3ForConditionalGeneration", 65, "mistral", tie=True,
                   **LLAVA),
]
