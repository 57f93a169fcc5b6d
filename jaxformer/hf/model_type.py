"""HFModelType: one Hugging Face model_type's row (jaxformer.hf.families holds the rows)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxformer.hf import llama_layout
from jaxformer.hf.moe_layout import MoEFormat
from jaxformer.hf.tensors import Rule


@dataclasses.dataclass(frozen=True)
class HFModelType:
    """One Hugging Face model_type.

    name, architectures: config.json's model_type and the architectures read (an LM head or
      the bare model; the first is written). export_rank: to_hf writes a model as the
      first model type, by rank, whose config.json reads back as the same model.
    defaults: transformers' values of the keys a config.json may lack.

    The format. read_config(hf, get, row) -> ModelConfig (get: a key or its default);
      write_config(cfg, row) -> config.json keys; tensor_rules(cfg, row, rope_layout) ->
      [Rule]. tensor_prefix: what a bare-model checkpoint's names lack; head_tensor: the
      untied LM head's name; ignored_tensors: buffers that are not params (regexes);
      fan_in_fan_out: weights stored [in, out] (GPT-2's Conv1D), as PEFT records it.

    The Llama lineage's twists (read by llama_layout and jaxformer.hf.layers). norm, block,
      qk_norm: ModelConfig's. biases: "attention_and_mlp" (attention_bias on q, k, v, o and
      mlp_bias, equal), "attention" (attention_bias on q, k, v, o; no MLP key), "qkv" (q,
      k, v always, as Qwen2), "qkv_bias" (q, k, v as its qkv_bias key says), "none",
      "attention_no_mlp" (attention_bias on q, k, v, o, in a model with no dense MLP).
      act_key, eps_key: the activation's and the norm epsilon's keys; act_aliases:
      activation names the config class rewrites.
      fused_projections: q|k|v in one qkv_proj, gate|up in one gate_up_proj.
      rope_layout: the checkpoint's own q/k layout ("interleaved": adjacent pairs (2i, 2i+1),
      permuted to jaxformer's half layout and back). rotary_fraction_key: the top-level key
      of the rotated share of a head (None: every dimension is rotated). rope_scalings: the
      RoPE scalings the config class takes (None: all). rope_per_type: rope_parameters keyed
      by layer type, with theta defaults per type and legacy keys (key -> type).
    Layers. layer_type(get, i): layer i's type when config.json lists no layer_types (None:
      every layer full attention); layer_types_key: config.json may list layer_types;
      use_sliding_window: a window only where use_sliding_window is true (written with
      max_window_layers 0); rope_of(get, i, type): whether layer i is rotated (None: all).
    extra(get) -> more ModelConfig fields (jaxformer.hf.scales: multipliers, soft-caps);
      extra_to_hf(cfg) -> their keys. refuse: (key, the values read, why) for the rest.
    moe: the mixture of experts (jaxformer.hf.moe_layout.MoEFormat); None: dense. mla: the
      attention is multi-head latent attention (jaxformer.hf.mla_layout). extra_layers: what
      tensors of layers past the last are (skipped on import with one line saying so);
      None: such tensors are an error.
    arch: the model.arch its checkpoints hold (to_hf tries the rows of a model's arch alone).
    mixers: the layer mixers its checkpoints may hold (jaxformer.model.mixers; to_hf tries
      the rows whose mixers include every one of a model's).
    """

    name: str
    architectures: tuple[str, ...]
    export_rank: int
    defaults: Mapping[str, Any]
    read_config: Callable = llama_layout.read_config
    write_config: Callable = llama_layout.write_config
    tensor_rules: Callable[..., list[Rule]] = llama_layout.tensor_rules
    tensor_prefix: str = "model."
    head_tensor: str = "lm_head.weight"
    ignored_tensors: tuple[str, ...] = llama_layout.BUFFERS
    fan_in_fan_out: bool = False
    norm: str = "rmsnorm"
    block: str = "pre_ln"
    qk_norm: str = "none"
    biases: str = "attention_and_mlp"
    act_key: str = "hidden_act"
    act_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    eps_key: str = "rms_norm_eps"
    fused_projections: bool = False
    rope_layout: str = "half"
    rotary_fraction_key: str | None = None
    rope_scalings: tuple[str, ...] | None = None
    rope_per_type: Mapping[str, dict] | None = None
    layer_type: Callable | None = None
    layer_types_key: bool = False
    use_sliding_window: bool = False
    rope_of: Callable | None = None
    extra: Callable[[Callable], dict] = lambda get: {}
    extra_to_hf: Callable[[Any], dict] = lambda cfg: {}
    refuse: tuple[tuple[str, Any, str], ...] = ()
    moe: MoEFormat | None = None
    mla: bool = False
    extra_layers: str | None = None
    arch: str = "decoder"
    mixers: tuple[str, ...] = ("attention",)
