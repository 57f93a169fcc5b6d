"""The gated delta rule's hybrids (jaxformer.model.mixers.gated_delta): Qwen3-Next and
Qwen3.5 (dense, and its mixture of experts): their config.json readers and writers and
tensor rules, and their rows.

config.json: Llama's keys (jaxformer.hf.llama_layout reads and writes them: RMSNorm
scaled by 1 + w everywhere but the gated delta layers' own norm, the QK-norm per head
too; RoPE on partial_rotary_factor of a head, 0.25 unless given; the experts as Qwen2-MoE
has them, a sigmoid-gated shared expert, decoder_sparse_step and mlp_only_layers), and
layer_types (linear_attention or full_attention per layer; else every
full_attention_interval-th layer attends), linear_num_value_heads, linear_num_key_heads,
linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim. Attention is gated
(model.attn_output_gate). Qwen3.5's MRoPE (mrope_section) rotates text as plain RoPE.

Tensors, under model.: Llama's, but an attention layer's q_proj [N * 2H, D] holds each
head's query then its gate (attn/query, attn/gate); a linear_attention layer's
linear_attn: Qwen3-Next's in_proj_qkvz [Kh * (2Dk + 2rDv), D] grouped by key head
(q, k, then the r = heads / key_heads value heads' v, then their z) and in_proj_ba
[Kh * 2r, D] (b, a per key head); Qwen3.5's in_proj_qkv (q | k | v rows), in_proj_z,
in_proj_b, in_proj_a; both: conv1d [C, 1, K], A_log, dt_bias, norm (norm_scale),
out_proj. A Qwen3_5ForConditionalGeneration folder holds its text model under
model.language_model. beside the vision tower (model.visual.), which is skipped
(jaxformer.hf.multimodal).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jaxformer.hf import llama_layout
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat, moe_rules
from jaxformer.hf.multimodal import multimodal_row
from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import (Path, Rule, copied, linear, one_tensor, reshaped,
                                  rope_permutation, split_rows)
from jaxformer.model.config import ModelConfig

DELTA = "gated_delta"  # the linear_attention layers' mixer
# config.json's layer type -> (our kind's name, its LayerKind fields)
KINDS = {"linear_attention": ("linear", {"mixer": DELTA}), "full_attention": ("full", {})}
TYPE_OF = {DELTA: "linear_attention", "attention": "full_attention"}  # a mixer's layer type
# GatedDeltaSettings field -> its config.json key
SETTINGS_KEYS = dict(heads="linear_num_value_heads", key_heads="linear_num_key_heads",
                     key_dim="linear_key_head_dim", value_dim="linear_value_head_dim",
                     conv="linear_conv_kernel_dim")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # equal positions for text: plain RoPE


# ---- config.json ----------------------------------------------------------------------


def _layer_types(get, family: str) -> list[str]:
    """Each layer's type: layer_types, else full attention every full_attention_interval-th
    layer (as the config classes fill it in)."""
    n = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        every = get("full_attention_interval")
        if not isinstance(every, int) or every < 1:
            raise unsupported("full_attention_interval", every, f"{family}'s interval must "
                              "be a positive integer")
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise unsupported("layer_types", types, f"{family} lists one type per layer ({n})")
    bad = sorted(set(types) - set(KINDS))
    if bad:
        raise unsupported("layer_types", bad, f"{family} layers are {' or '.join(KINDS)}")
    return types


def _period(names: list[str]) -> tuple[str, ...]:
    """The shortest prefix that, repeated, gives `names`."""
    return next(tuple(names[:p]) for p in range(1, len(names) + 1)
                if all(names[i] == names[i % p] for i in range(len(names))))


def hybrid_fields(get, family: str) -> dict[str, Any]:
    """The layer pattern, the gated delta layers' settings and the gated attention (the
    `extra` fields llama_layout's reader adds to the attention model it reads)."""
    names = [KINDS[t][0] for t in _layer_types(get, family)]
    settings = {field: get(key) for field, key in SETTINGS_KEYS.items()}
    fields = dict(layer_pattern=_period(names), attn_output_gate=True,
                  layer_kinds={name: dict(kind) for name, kind in KINDS.values()
                               if name in names},
                  mixer={DELTA: settings} if KINDS["linear_attention"][0] in names else None)
    if KINDS["full_attention"][0] not in names:  # nothing attends: nothing to rotate
        fields.update(position="none", rope_fraction=1.0)
    return fields


def hybrid_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """layer_types and the gated delta layers' keys (a row's extra_to_hf)."""
    types = []
    for i in cfg.layer_kind_ids:
        kind = cfg.kinds[i]
        if kind.mixer not in TYPE_OF or not kind.ffn:
            raise cannot("layer_kinds", f"mixer={kind.mixer}, ffn={kind.ffn}", "the layers "
                         "of this family are gated delta or attention ones, each with an MLP")
        types.append(TYPE_OF[kind.mixer])
    if not cfg.attn_output_gate:
        raise cannot("attn_output_gate", False, "this family's attention is gated")
    s = cfg.mixer_settings(DELTA)
    values = dict(s.to_dict(), key_heads=s.n_key_heads)
    return dict(layer_types=types, **{key: values[field] for field, key in SETTINGS_KEYS.items()})


def read_config(hf, get, row) -> ModelConfig:
    """llama_layout's reader with the hybrid's fields (hybrid_fields, as the row's extra),
    Qwen3.5's MRoPE keys aside: text has the same position in each of its sections."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and set(MROPE_KEYS) & set(params):
        hf = dict(hf, rope_parameters={k: v for k, v in params.items() if k not in MROPE_KEYS})
    extra = functools.partial(hybrid_fields, family=row.name)
    return llama_layout.read_config(hf, get, dataclasses.replace(row, extra=extra))


# ---- tensors ----------------------------------------------------------------------


def _grouped_rule(m: Path, ours: tuple[str, ...], name: str, d: int, kh: int,
                  widths: tuple[int, ...], shapes) -> Rule:
    """A Linear [Kh * sum(widths), D] whose rows are grouped by key head, each group the
    parts side by side <-> kernels of `shapes` ([D, Kh, w] reshaped: a part spanning r
    value heads of a key head becomes [D, Kh * r, w / r], heads in order)."""
    cuts = list(np.cumsum(widths)[:-1])

    def to_ours(w):
        parts = np.split(w.T.reshape(d, kh, sum(widths)), cuts, axis=-1)  # [D, Kh, w]
        return tuple(p.reshape(shape) for p, shape in zip(parts, shapes))

    def to_hf(*ks):
        parts = [k.reshape(d, kh, w) for k, w in zip(ks, widths)]
        return (np.concatenate(parts, axis=-1).reshape(d, -1).T,)  # [Kh * sum, D]
    return Rule(tuple(m + (o, "kernel") for o in ours), (name,), ((kh * sum(widths), d),),
                to_ours, to_hf)


def fused_projections(cfg: ModelConfig, m: Path, p: str) -> list[Rule]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head."""
    s, d = cfg.mixer_settings(DELTA), cfg.d_model
    kh, h, dk, dv = s.n_key_heads, s.heads, s.key_dim, s.value_dim
    r = h // kh
    return [_grouped_rule(m, ("query", "key", "value", "z"), f"{p}in_proj_qkvz.weight", d, kh,
                          (dk, dk, r * dv, r * dv), ((d, kh, dk), (d, kh, dk), (d, h, dv),
                                                     (d, h, dv))),
            _grouped_rule(m, ("b", "a"), f"{p}in_proj_ba.weight", d, kh, (r, r),
                          ((d, h), (d, h)))]


def split_projections(cfg: ModelConfig, m: Path, p: str) -> list[Rule]:
    """Qwen3.5's in_proj_qkv (q | k | v rows), in_proj_z, in_proj_b, in_proj_a."""
    s, d = cfg.mixer_settings(DELTA), cfg.d_model
    kh, h, dk, dv = s.n_key_heads, s.heads, s.key_dim, s.value_dim
    return [split_rows(m, ("query", "key", "value"), f"{p}in_proj_qkv.weight",
                       (kh * dk, kh * dk, h * dv), d, ((d, kh, dk), (d, kh, dk), (d, h, dv))),
            linear(m + ("z", "kernel"), f"{p}in_proj_z.weight", (h * dv, d), (d, h, dv)),
            linear(m + ("b", "kernel"), f"{p}in_proj_b.weight", (h, d), (d, h)),
            linear(m + ("a", "kernel"), f"{p}in_proj_a.weight", (h, d), (d, h))]


def delta_rules(cfg: ModelConfig, m: Path, p: str, projections) -> list[Rule]:
    """A linear_attn module's tensors: its input projections (`projections`), the
    depthwise convolution [C, 1, K] <-> [K, C], A_log, dt_bias, the gated norm's weight,
    out_proj [D, H * Dv] <-> [H, Dv, D]."""
    s, d = cfg.mixer_settings(DELTA), cfg.d_model
    h, c = s.heads, s.conv_channels
    return projections(cfg, m, p) + [
        one_tensor(m + ("conv",), f"{p}conv1d.weight", (c, 1, s.conv),
                   lambda w: w[:, 0, :].T, lambda k: k.T[:, None, :]),  # [K, C]
        copied(m + ("A_log",), f"{p}A_log", (h,)),
        copied(m + ("dt_bias",), f"{p}dt_bias", (h,)),
        copied(m + ("norm_scale",), f"{p}norm.weight", (s.value_dim,)),
        linear(m + ("out", "kernel"), f"{p}out_proj.weight", (d, h * s.value_dim),
               (h, s.value_dim, d))]


def gated_attention_rules(cfg: ModelConfig, a: Path, p: str, rope) -> list[Rule]:
    """q_proj [N * 2H, D] (each head's query rows, then its gate's) <-> query, gate
    [D, N, H]; k_proj, v_proj, o_proj and the per-head QK-norm weights as Llama's."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    fwd, inv = rope or (lambda x: x, lambda x: x)

    def to_ours(w):
        heads = w.T.reshape(d, n, 2, h)  # [D, N, query | gate, H]
        return fwd(heads[:, :, 0]), heads[:, :, 1]
    q_gate = Rule((a + ("query", "kernel"), a + ("gate", "kernel")), (f"{p}q_proj.weight",),
                  ((n * 2 * h, d),), to_ours,
                  lambda q, g: (np.stack([inv(q), g], axis=2).reshape(d, -1).T,))
    return [q_gate] + [
        linear(a + (ours, "kernel"), f"{p}{hf}.weight", (k * h, d), (d, k, h), post)
        for ours, hf, post in (("key", "k_proj", rope), ("value", "v_proj", None))] + [
        linear(a + ("out", "kernel"), f"{p}o_proj.weight", (d, n * h), (n, h, d))] + [
        reshaped(a + (x, "scale"), f"{p}{x}.weight", (h,), (h,), rope)
        for x in ("q_norm", "k_norm")]


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half", projections=None
                 ) -> list[Rule]:
    """The family's tensors (the module docstring); `projections`: the gated delta layers'
    input projections (fused_projections or split_projections)."""
    d, v = cfg.d_model, cfg.vocab_size
    rope, t = rope_permutation(rope_layout), row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i, mixer in enumerate(cfg.layer_mixers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        module, hf, layer_rules = LAYERS[mixer]
        rules += layer_rules(cfg, (b, module), f"{p}{hf}.", rope, projections)
        rules += [copied((b, ours, "scale"), f"{p}{hf}.weight", (d,))
                  for ours, hf in llama_layout.NORM_TENSORS["pre_ln"].items()]
        rules += moe_rules(cfg, row, b, p) if cfg.sparse_layers[i] else \
            llama_layout._mlp(cfg, (b, "ffn"), f"{p}mlp.", False)
    rules.append(copied(("final_norm", "scale"), f"{t}norm.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


# a layer's mixer -> (its params' module, its HF module, its rules)
LAYERS = {DELTA: ("mixer", "linear_attn",
                  lambda cfg, m, p, rope, projections: delta_rules(cfg, m, p, projections)),
          "attention": ("attn", "self_attn",
                        lambda cfg, a, p, rope, projections: gated_attention_rules(cfg, a, p,
                                                                                   rope))}


# ---- the rows -------------------------------------------------------------------------

VISION = {"vision tower": "model.visual."}  # a vision-language folder's skipped part
MTP = r"mtp\..*"  # the multi-token-prediction layers, which transformers does not load either
DEFAULTS = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, head_dim=256,
                rope_theta=10000.0, partial_rotary_factor=0.25, layer_types=None,
                full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
TWISTS = dict(
    read_config=read_config, norm="rmsnorm_offset", qk_norm="head", biases="attention",
    rotary_fraction_key="partial_rotary_factor", extra_to_hf=hybrid_to_hf,
    ignored_tensors=llama_layout.BUFFERS + (MTP,), mixers=("attention", DELTA),
    refuse=(("hidden_act", ("silu",), "the MLP and the gated delta layers' convolution are "
             "SiLU in jaxformer"),
            ("attention_bias", (False,), "jaxformer's gated attention here has no biases")))
ROUTER_LOSS = dict(output_router_logits=False, router_aux_loss_coef=0.001)
QWEN3_NEXT = HFModelType(
    "qwen3_next", ("Qwen3NextForCausalLM", "Qwen3NextModel"), export_rank=45,
    defaults=dict(DEFAULTS, num_key_value_heads=2, decoder_sparse_step=1, norm_topk_prob=True,
                  num_experts_per_tok=10, mlp_only_layers=None, **ROUTER_LOSS),
    tensor_rules=functools.partial(tensor_rules, projections=fused_projections),
    moe=MoEFormat("mlp", "gate", ("num_experts",), "softmax_topk", "norm_topk_prob",
                  "moe_intermediate_size", sparse_layers=True, shared_expert=True), **TWISTS)
QWEN3_5 = HFModelType(
    "qwen3_5_text", ("Qwen3_5ForCausalLM", "Qwen3_5TextModel"), export_rank=46,
    defaults=dict(DEFAULTS, num_key_value_heads=4),
    tensor_rules=functools.partial(tensor_rules, projections=split_projections), **TWISTS)
QWEN3_5_MOE = HFModelType(  # every layer sparse, the chosen experts' weights renormalised
    "qwen3_5_moe_text", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel"), export_rank=47,
    defaults=dict(DEFAULTS, num_key_value_heads=2, num_experts_per_tok=8,
                  intermediate_size=None, **ROUTER_LOSS),
    tensor_rules=functools.partial(tensor_rules, projections=split_projections),
    moe=MoEFormat("mlp", "gate", ("num_experts",), "topk_softmax", None,
                  "moe_intermediate_size", shared_expert=True), **TWISTS)


ROWS: list = [  # HFModelType rows (jaxformer.hf.model_type)
    QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE,
    # the vision-language folders: the text model read, the vision tower skipped
    multimodal_row("qwen3_5", "Qwen3_5ForConditionalGeneration", 48, QWEN3_5.name,
                   skipped=VISION),
    multimodal_row("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", 49, QWEN3_5_MOE.name,
                   skipped=VISION),
]
