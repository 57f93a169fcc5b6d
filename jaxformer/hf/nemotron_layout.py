"""NVIDIA's Nemotron-H (nemotron_h) and IBM's Granite 4 (granitemoehybrid): Mamba-2 layers
(jaxformer.model.mixers.mamba2) beside attention: config.json, tensor rules and rows.

Nemotron-H: each layer is one sublayer after an RMSNorm (backbone.layers.N.{norm, mixer}),
its type in layers_block_type (older files: hybrid_override_pattern's letters, M Mamba-2,
* attention, - MLP, E mixture of experts): linear_attention, Mamba-2 alone (kind "mamba":
mixer mamba2, ffn false), its step clamped below at time_step_min; full_attention,
attention alone, NoPE, no biases (kind "attention": ffn false); mlp, a squared-ReLU
up/down MLP alone (kind "mlp": mixer none); moe, the experts alone (kind "moe": mixer none,
a sparse layer): sigmoid routing, selection bias, groups, non-gated experts, a shared one;
the head never tied (NemotronHForCausalLM ties nothing).

Granite 4: every layer a mixer (layer_types: linear_attention, Mamba-2 under mamba;
full_attention, attention under self_attn) and a feed-forward network: the shared_mlp
(SwiGLU, input_linear = gate | up rows) alone, or beside the block_sparse_moe's experts
(softmax over the top-k logits) as their shared expert; Granite's multipliers
(jaxformer.hf.scales.granite); RoPE where position_embedding_type is rope, else NoPE.
"""

from __future__ import annotations

from typing import Any

from jaxformer.hf import scales
from jaxformer.hf.mamba2_layout import BAMBA_KEYS, mixer_rules, read_mamba2_settings, \
    write_mamba2_settings
from jaxformer.hf.model_type import HFModelType
from jaxformer.hf.moe_layout import MoEFormat, _per_expert, _stacked  # the experts' layouts
from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear, split_rows
from jaxformer.model.config import ModelConfig
from jaxformer.positions.schemes import POSITION_SCHEMES

# ---- layer types -------------------------------------------------------------------------

LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap
LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# layer type -> (its kind's name, mixer, ffn, sparse: None where the model's experts decide)
NEMOTRON_TYPES = {"linear_attention": ("mamba", "mamba2", False, False),
                  "full_attention": ("attention", "attention", False, False),
                  "mlp": ("mlp", "none", True, False), "moe": ("moe", "none", True, True)}
GRANITE_TYPES = {"linear_attention": ("mamba", "mamba2", True, None),
                 "full_attention": ("attention", "attention", True, None)}
# Nemotron-H's Mamba-2 keys: its in/out projections' bias is use_bias, and its step is
# clamped to (time_step_min, inf), whatever time_step_limit says
NEMOTRON_KEYS = dict(heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups",
                     state="ssm_state_size", conv="conv_kernel", chunk="chunk_size",
                     conv_bias="use_conv_bias", bias="use_bias", dt_min="time_step_min",
                     dt_max="time_step_max", dt_floor="time_step_floor",
                     dt_limit_low="time_step_min", act="mamba_hidden_act")
# older Nemotron-H keys, which NemotronHConfig reads in place of the new ones
NEMOTRON_LEGACY = dict(n_groups="mamba_n_groups", conv_kernel="mamba_d_conv",
                       time_step_min="mamba_dt_min", time_step_max="mamba_dt_max",
                       time_step_floor="mamba_dt_init_floor", use_conv_bias="mamba_conv_bias",
                       chunk_size="mamba_chunk_size", n_routed_experts="num_local_experts")
MLP_ACTS = {"relu2": "relu2", "relu": "relu"}  # Nemotron-H's mlp_hidden_act -> model.ffn
POSITIONS = {None: "none", "rope": "rope"}  # Granite 4's position_embedding_type -> position


def _special_float(v):
    """transformers' JSON spelling of inf and nan ({"__float__": "Infinity"}) as a float."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        return float(v["__float__"])
    return [_special_float(x) for x in v] if isinstance(v, list) else v


def _reader(hf, get, legacy: dict | None = None):
    """get, reading transformers' special floats, and a key's older name if there (it wins)."""
    return lambda key, *default: _special_float(
        hf[legacy[key]] if key in (legacy or {}) and legacy[key] in hf else get(key, *default))


def _checked_types(types, n, table, key: str, family: str) -> list[str]:
    """A list of layer types, the older names read as transformers reads them."""
    if not isinstance(types, list) or not types or (n is not None and len(types) != n):
        raise unsupported(key, types, f"{family} lists one layer type per layer"
                          + (f" ({n})" if n is not None else ""))
    types = [LEGACY_TYPES.get(t, t) for t in types]
    bad = sorted(set(types) - set(table))
    if bad:
        raise unsupported(key, bad, f"{family}'s layer types are {', '.join(table)}")
    return types


def nemotron_types(hf) -> list[str]:
    """Nemotron-H's layer types: layers_block_type (or its alias layer_types), else the
    letters of hybrid_override_pattern, else the config class's default."""
    for key in ("layers_block_type", "layer_types"):
        if hf.get(key) is not None:
            return _checked_types(hf[key], None, NEMOTRON_TYPES, key, "nemotron_h")
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None:
        return ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(LETTERS):
        raise unsupported("hybrid_override_pattern", pattern, "nemotron_h's letters are M "
                          "(Mamba-2), * (attention), - (MLP) and E (mixture of experts)")
    return [LETTERS[c] for c in pattern]


def _pattern(types: list[str], table) -> dict[str, Any]:
    """layer_pattern (each layer's kind) and layer_kinds of a list of layer types."""
    kinds = {table[t][0]: dict(mixer=table[t][1], ffn=table[t][2]) for t in types}
    return dict(layer_pattern=tuple(table[t][0] for t in types), layer_kinds=kinds)


def _types_of(cfg: ModelConfig, table, family: str) -> list[str]:
    """Each layer's type in the family's table, from its mixer, FFN and sparsity."""
    out = []
    for i, form in enumerate(zip(cfg.layer_mixers, cfg.layer_ffns, cfg.sparse_layers)):
        found = [t for t, (_, mixer, ffn, sparse) in table.items()
                 if (mixer, ffn) == form[:2] and sparse in (None, form[2])]
        if not found:
            forms = "; ".join(f"{m} (ffn {f}, sparse {s})" for _, m, f, s in table.values())
            raise cannot("layer_kinds", f"layer {i}: mixer {form[0]}, ffn {form[1]}, sparse "
                         f"{form[2]}", f"{family}'s layers are mixers {forms}")
        out.append(found[0])
    return out


def _mixer_settings(types, get, keys, family: str) -> dict[str, Any]:
    """model.mixer where some layer is Mamba-2 (an unused mixer's settings are refused)."""
    if "linear_attention" not in types:
        return {}
    return dict(mixer={"mamba2": read_mamba2_settings(get, keys, family)})


def _refuse(get, refusals, family: str):
    for key, allowed, why in refusals:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({family})")


# ---- Nemotron-H config.json ------------------------------------------------------------

NEMOTRON_REFUSE = (
    ("mlp_hidden_act", tuple(MLP_ACTS), "Nemotron-H's MLP in jaxformer is squared ReLU (relu2) "
     "or ReLU"),
    ("mlp_bias", (False,), "jaxformer's biases are on every linear layer or none, and "
     "Nemotron-H's attention has none"),
    ("moe_latent_size", (None,), "jaxformer's experts read the hidden state itself, without "
     "latent projections"))


def read_nemotron(hf, get, row) -> ModelConfig:
    """The ModelConfig of a Nemotron-H config.json."""
    get = _reader(hf, get, NEMOTRON_LEGACY)
    _refuse(get, NEMOTRON_REFUSE, row.name)
    types = nemotron_types(hf)
    d, n_heads = get("hidden_size"), get("num_attention_heads")
    fields = dict(
        vocab_size=get("vocab_size"), d_model=d, n_layers=len(types), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads,
        head_dim=get("head_dim") or d // n_heads, d_ff=get("intermediate_size"),
        max_seq_len=get("max_position_embeddings"), position="none", norm="rmsnorm",
        norm_eps=float(get("layer_norm_epsilon")), ffn=MLP_ACTS[get("mlp_hidden_act")],
        use_bias=False, tie_embeddings=False, **_pattern(types, NEMOTRON_TYPES),
        **_mixer_settings(types, get, NEMOTRON_KEYS, row.name))
    if "moe" in types:
        fields["moe"] = dict(
            experts=get("n_routed_experts"), top_k=get("num_experts_per_tok"),
            d_ff=get("moe_intermediate_size"), shared_experts=1,
            shared_d_ff=get("moe_shared_expert_intermediate_size"), router="sigmoid",
            norm_topk=bool(get("norm_topk_prob")), groups=get("n_group") or 1,
            topk_groups=get("topk_group") or 1, routed_scale=float(get("routed_scaling_factor")),
            layers=tuple(i for i, t in enumerate(types) if t == "moe"))
    return ModelConfig(**fields)


def write_nemotron(cfg: ModelConfig, row) -> dict[str, Any]:
    """Nemotron-H's config.json keys; what it cannot say shows in the round trip."""
    acts = {ours: hf for hf, ours in MLP_ACTS.items()}
    if cfg.ffn not in acts:
        raise cannot("ffn", cfg.ffn, f"{row.name}'s MLP is {' or '.join(acts)}")
    out = dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
               layers_block_type=_types_of(cfg, NEMOTRON_TYPES, row.name),
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
               layer_norm_epsilon=cfg.norm_eps, mlp_hidden_act=acts[cfg.ffn], mlp_bias=False,
               attention_bias=False, initializer_range=0.02, residual_in_fp32=False,
               **write_mamba2_settings(cfg.mixer_settings("mamba2"), NEMOTRON_KEYS,
                                       cfg.d_model, row.name))
    m = cfg.moe
    if m.experts:
        out.update(n_routed_experts=m.experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=cfg.expert_d_ff,
                   moe_shared_expert_intermediate_size=cfg.shared_d_ff, n_shared_experts=1,
                   norm_topk_prob=m.norm_topk, n_group=m.groups, topk_group=m.topk_groups,
                   routed_scaling_factor=m.routed_scale, moe_latent_size=None)
    return out


# ---- Granite 4 config.json -------------------------------------------------------------

GRANITE_REFUSE = (
    ("hidden_act", ("silu",), "Granite 4's MLP in jaxformer is SwiGLU and its Mamba-2 "
     "convolution's activation SiLU"),
    ("attention_bias", (False,), "jaxformer's biases are on every linear layer or none, and "
     "Granite 4's MLP has none"),
    ("position_embedding_type", tuple(POSITIONS), "Granite 4's attention is NoPE (null) or "
     "RoPE (rope)"))


def _granite_position(hf, get, types, row) -> dict[str, Any]:
    """model.position (none where no layer attends) and the RoPE of a Granite 4 file."""
    position = POSITIONS[get("position_embedding_type")] if "full_attention" in types else "none"
    if POSITION_SCHEMES[position].kind != "rotary":
        return dict(position=position)
    theta, scaling = rope_from_hf(hf, get, get("max_position_embeddings"))
    if rotary_fraction(hf, get) != 1:
        raise unsupported("partial_rotary_factor", rotary_fraction(hf, get),
                          f"{row.name} rotates every dimension of a head")
    return dict(position=position, rope_theta=float(theta), rope_scaling=scaling)


def read_granite(hf, get, row) -> ModelConfig:
    """The ModelConfig of a Granite 4 (granitemoehybrid) config.json."""
    get = _reader(hf, get)
    _refuse(get, GRANITE_REFUSE, row.name)
    n = get("num_hidden_layers")
    key = "layer_types" if hf.get("layer_types") is not None else "layers_block_type"
    types = _checked_types(get(key, None) or ["linear_attention"] * n, n, GRANITE_TYPES, key,
                           row.name)
    d, n_heads = get("hidden_size"), get("num_attention_heads")
    experts = get("num_local_experts") or 0
    fields = dict(
        vocab_size=get("vocab_size"), d_model=d, n_layers=n, n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads,
        head_dim=get("head_dim", None) or d // n_heads,
        d_ff=get("intermediate_size") if experts else get("shared_intermediate_size"),
        max_seq_len=get("max_position_embeddings"), norm="rmsnorm",
        norm_eps=float(get("rms_norm_eps")), ffn="swiglu", use_bias=False,
        tie_embeddings=bool(get("tie_word_embeddings")), **_pattern(types, GRANITE_TYPES),
        **_mixer_settings(types, get, BAMBA_KEYS, row.name), **scales.granite(get),
        **_granite_position(hf, get, types, row))
    if experts:
        top_k = get("num_experts_per_tok")
        # the balancing loss as jaxformer.hf.moe_layout.read_moe reads it
        aux = float(get("router_aux_loss_coef")) * top_k if get("output_router_logits") else 0.0
        fields["moe"] = dict(experts=experts, top_k=top_k, router="topk_softmax",
                             shared_experts=1, shared_d_ff=get("shared_intermediate_size"),
                             aux_loss=aux)
    return ModelConfig(**fields)


def write_granite(cfg: ModelConfig, row) -> dict[str, Any]:
    """Granite 4's config.json keys; what it cannot say shows in the round trip."""
    m = cfg.moe
    if m.experts and not m.shared_experts:
        raise cannot("moe.shared_experts", 0, f"{row.name}'s sparse layers have a shared MLP")
    out = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
               layer_types=_types_of(cfg, GRANITE_TYPES, row.name),
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
               rms_norm_eps=cfg.norm_eps,
               attention_bias=False, initializer_range=0.02,
               position_embedding_type={v: k for k, v in POSITIONS.items()}.get(cfg.position),
               rope_parameters=rope_dict(cfg.rope_theta, cfg.rope_scaling),
               intermediate_size=cfg.expert_d_ff,
               shared_intermediate_size=cfg.shared_d_ff if m.experts else cfg.d_ff,
               num_local_experts=m.experts, **scales.granite_to_hf(cfg),
               **write_mamba2_settings(cfg.mixer_settings("mamba2"), BAMBA_KEYS, cfg.d_model,
                                       row.name))
    if m.experts:
        out.update(num_experts_per_tok=m.top_k, output_router_logits=m.aux_loss > 0,
                   router_aux_loss_coef=m.aux_loss / m.top_k if m.aux_loss > 0 else 0.001)
    return out


# ---- tensors -------------------------------------------------------------------------


def _attention(cfg: ModelConfig, b: str, p: str) -> list[Rule]:
    """Layer b's attention: q, k, v and o projections without biases under prefix p."""
    d, n, k, h, a = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, (b, "attn")
    return [*(linear(a + (ours, "kernel"), f"{p}{hf}.weight", (m * h, d), (d, m, h))
              for ours, hf, m in (("query", "q_proj", n), ("key", "k_proj", k),
                                  ("value", "v_proj", k))),
            linear(a + ("out", "kernel"), f"{p}o_proj.weight", (d, n * h), (n, h, d))]


def _mamba(cfg: ModelConfig, b: str, p: str) -> list[Rule]:
    """Layer b's Mamba-2 mixer under prefix p (jaxformer.hf.mamba2_layout)."""
    return mixer_rules(cfg, (b,), p, cfg.mixer_settings("mamba2"))


def _up_down(m: Path, p: str, d: int, f: int) -> list[Rule]:
    """A non-gated MLP: up_proj [F, D] <-> wi [D, F], down_proj [D, F] <-> wo [F, D]."""
    return [linear(m + ("wi", "kernel"), f"{p}up_proj.weight", (f, d), (d, f)),
            linear(m + ("wo", "kernel"), f"{p}down_proj.weight", (d, f), (f, d))]


def _nemotron_moe(cfg: ModelConfig, b: str, p: str) -> list[Rule]:
    """Layer b's mixture of experts under p (backbone.layers.N.mixer.)."""
    d, e, f, m = cfg.d_model, cfg.moe.experts, cfg.expert_d_ff, (b, "ffn")
    return [linear(m + ("router", "kernel"), f"{p}gate.weight", (e, d), (d, e)),
            copied(m + ("score_bias",), f"{p}gate.e_score_correction_bias", (e,)),
            _per_expert(m + ("wi",), [f"{p}experts.{j}.up_proj.weight" for j in range(e)],
                        (f, d)),
            _per_expert(m + ("wo",), [f"{p}experts.{j}.down_proj.weight" for j in range(e)],
                        (d, f)),
            *_up_down(m + ("shared",), f"{p}shared_experts.", d, cfg.shared_d_ff)]


# a layer type's tensors: (cfg, our layer's name, its prefix) -> rules
NEMOTRON_SUBLAYERS = {"linear_attention": _mamba, "full_attention": _attention,
                      "moe": _nemotron_moe,
                      "mlp": lambda cfg, b, p: _up_down((b, "ffn"), p, cfg.d_model, cfg.d_ff)}


def nemotron_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """Nemotron-H's tensors (rope_layout: no layer rotates)."""
    d, v, t = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embeddings.weight", (v, d))]
    for i, kind in enumerate(_types_of(cfg, NEMOTRON_TYPES, row.name)):
        b, p = f"block_{i}", f"{t}layers.{i}."
        norm = "ffn_norm" if cfg.layer_ffns[i] else "attn_norm"  # the block form's one norm
        rules.append(copied((b, norm, "scale"), f"{p}norm.weight", (d,)))
        rules += NEMOTRON_SUBLAYERS[kind](cfg, b, f"{p}mixer.")
    rules += [copied(("final_norm", "scale"), f"{t}norm_f.weight", (d,)),
              linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v))]
    return rules


def _gate_up(m: Path, name: str, d: int, f: int) -> Rule:
    """Granite's input_linear [2F, D] (gate rows, then up) <-> wi_gate, wi_up [D, F]."""
    return split_rows(m, ("wi_gate", "wi_up"), name, (f, f), d, ((d, f), (d, f)))


def _granite_ffn(cfg: ModelConfig, m: Path, p: str) -> list[Rule]:
    """The shared_mlp (the FFN, or the experts' shared expert) and the experts."""
    d, e = cfg.d_model, cfg.moe.experts
    s, shared = (cfg.shared_d_ff, m + ("shared",)) if e else (cfg.d_ff, m)
    rules = [_gate_up(shared, f"{p}shared_mlp.input_linear.weight", d, s),
             linear(shared + ("wo", "kernel"), f"{p}shared_mlp.output_linear.weight", (d, s),
                    (s, d))]
    if e:
        q = f"{p}block_sparse_moe."
        rules += [linear(m + ("router", "kernel"), f"{q}router.layer.weight", (e, d), (d, e)),
                  *_stacked(m, (f"{q}input_linear.weight", f"{q}output_linear.weight"), e, d,
                            cfg.expert_d_ff)]
    return rules


# a layer type's mixer: (its rules, its module's name)
GRANITE_MIXERS = {"linear_attention": (_mamba, "mamba."), "full_attention": (_attention,
                                                                            "self_attn.")}


def granite_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """Granite 4's tensors (rope_layout: the checkpoints rotate halves, as transformers)."""
    if rope_layout != "half":
        raise ValueError(f"rope_layout={rope_layout!r}: {row.name} checkpoints rotate halves")
    d, v, t = cfg.d_model, cfg.vocab_size, row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i, kind in enumerate(_types_of(cfg, GRANITE_TYPES, row.name)):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += [copied((b, "attn_norm", "scale"), f"{p}input_layernorm.weight", (d,)),
                  copied((b, "ffn_norm", "scale"), f"{p}post_attention_layernorm.weight", (d,))]
        mixer, module = GRANITE_MIXERS[kind]
        rules += mixer(cfg, b, p + module)
        rules += _granite_ffn(cfg, (b, "ffn"), p)
    rules.append(copied(("final_norm", "scale"), f"{t}norm.weight", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


# ---- the rows --------------------------------------------------------------------------

ROWS: list = [
    HFModelType(
        "nemotron_h", ("NemotronHForCausalLM", "NemotronHModel"), export_rank=40,
        mixers=("attention", "mamba2", "none"),
        defaults=dict(num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      mlp_hidden_act="relu2", mlp_bias=False, layer_norm_epsilon=1e-5,
                      mamba_hidden_act="silu", n_groups=8, ssm_state_size=128, conv_kernel=4,
                      chunk_size=128, use_conv_bias=True, use_bias=False, time_step_min=0.001,
                      time_step_max=0.1, time_step_floor=1e-4, num_experts_per_tok=2,
                      moe_latent_size=None, norm_topk_prob=True, n_group=1, topk_group=1,
                      routed_scaling_factor=1.0),
        read_config=read_nemotron, write_config=write_nemotron, tensor_rules=nemotron_rules,
        tensor_prefix="backbone.", ignored_tensors=(r"mtp\..*",),
        moe=MoEFormat("mixer", "gate", ("n_routed_experts", "num_local_experts"), "sigmoid",
                      "norm_topk_prob", "moe_intermediate_size", dense_too=True)),
    HFModelType(
        "granitemoehybrid", ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel"),
        export_rank=41, mixers=("attention", "mamba2"),
        defaults=dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      embedding_multiplier=1.0, residual_multiplier=1.0,
                      attention_multiplier=1.0, logits_scaling=1.0, rope_theta=10000.0,
                      num_experts_per_tok=2, output_router_logits=False,
                      router_aux_loss_coef=0.001, position_embedding_type=None,
                      mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
                      mamba_proj_bias=False, time_step_limit=[0.0, float("inf")]),
        read_config=read_granite, write_config=write_granite, tensor_rules=granite_rules,
        moe=MoEFormat("block_sparse_moe", "router.layer", ("num_local_experts",),
                      "topk_softmax", stacked=("input_linear", "output_linear"), dense_too=True)),
]
