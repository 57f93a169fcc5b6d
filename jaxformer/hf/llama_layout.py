"""The Llama layout (model.layers.N.self_attn.q_proj, mlp.gate_proj, ...): the config.json
reader and writer and the tensor rules of every model type whose checkpoint has it, each
with its own twists, which its row in jaxformer.hf.families states and this module follows.

Layer types (HF's layer_types: full_attention / sliding_attention per layer, and NoPE
layers) become a model.layer_pattern of kinds named after them (jaxformer.hf.layers); a
family's experts (its row's moe) become model.moe and the sparse layers' tensors
(jaxformer.hf.moe_layout).
"""

from __future__ import annotations

from typing import Any

from jaxformer.hf.layers import (layer_fields, layers_to_hf, rope_per_type_from_hf,
                                 rope_per_type_to_hf)
from jaxformer.hf.mla_layout import mla_rope, mla_rules, read_mla, write_mla
from jaxformer.hf.moe_layout import moe_rules, read_moe, write_moe
from jaxformer.hf.rope import cannot, rope_dict, rope_from_hf, rotary_fraction, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear, reshaped, rope_permutation, split_rows
from jaxformer.model.config import ConfigError, ModelConfig
from jaxformer.model.kinds import NORMS, QK_NORMS
from jaxformer.positions.formulas import rotary_dims

ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
# checkpoint buffers that are not params (RoPE tables, Gemma's embedding scale)
BUFFERS = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
           r"(model\.)?rotary_emb\.\w*inv_freq", r"(model\.)?embed_tokens\.embed_scale")


def head_dim(get) -> int:
    return get("head_dim") or get("hidden_size") // get("num_attention_heads")


def _biases(get, row) -> tuple[bool, bool]:
    """(use_bias, qkv_bias) from the model type's bias keys (row.biases)."""
    if row.biases == "qkv":
        return False, True
    if row.biases == "qkv_bias":
        return False, bool(get("qkv_bias"))
    if row.biases == "none":
        return False, False
    if row.biases == "attention_no_mlp":  # no dense MLP to carry use_bias
        return bool(get("attention_bias")), bool(get("attention_bias"))
    attention = bool(get("attention_bias"))
    mlp = bool(get("mlp_bias")) if row.biases == "attention_and_mlp" else False
    if attention != mlp:
        raise ConfigError(
            f"config.json attention_bias={attention} with mlp_bias={mlp} is not supported for "
            f"{row.name}: jaxformer's use_bias puts biases on every linear layer (q, k, v, o "
            "and the MLP) or on none (qkv_bias alone covers q, k, v only, as Qwen2)")
    return attention, attention


def _fraction(hf, get, row) -> float:
    """The rotated share of a head; 1 unless the model type has a key for it."""
    fraction = rotary_fraction(hf, get, row.rotary_fraction_key or "partial_rotary_factor")
    if row.rotary_fraction_key is None and fraction != 1:
        raise unsupported("partial_rotary_factor", fraction, f"{row.name} rotates every "
                          "dimension of a head")
    return fraction


def _ropes(hf, get, row, max_len: int) -> dict:
    """layer type -> (theta, RopeScaling)."""
    if row.rope_per_type:
        return rope_per_type_from_hf(hf, get, max_len, **row.rope_per_type)
    theta, scaling = rope_from_hf(hf, get, max_len)
    if row.rope_scalings is not None and scaling.kind not in row.rope_scalings:
        raise unsupported("rope_parameters.rope_type", rope_dict(theta, scaling)["rope_type"],
                          f"transformers' {row.name} config takes no such RoPE scaling "
                          "(Phi-3: default, or longrope, which jaxformer lacks)")
    return {"full_attention": (theta, scaling), "sliding_attention": (theta, scaling)}


def read_config(hf, get, row) -> ModelConfig:
    """The ModelConfig of a Llama-layout config.json (`get` reads a key or its default)."""
    for key, allowed, why in row.refuse:
        if get(key) not in allowed:
            raise unsupported(key, get(key), f"{why} ({row.name})")
    act = get(row.act_key)
    act = row.act_aliases.get(act, act)
    if act not in ACTIVATIONS:
        raise unsupported(row.act_key, act, f"{row.name}'s MLP in jaxformer is silu "
                          "(SwiGLU) or gelu_pytorch_tanh / gelu_new (GeGLU, tanh GELU)")
    n_heads, max_len = get("num_attention_heads"), get("max_position_embeddings")
    use_bias, qkv_bias = _biases(get, row)
    fraction = _fraction(hf, get, row)
    ropes = _ropes(hf, get, row, max_len)
    fields = dict(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=head_dim(get),
        d_ff=get("intermediate_size"), max_seq_len=max_len, position="rope",
        rope_fraction=fraction, norm=row.norm, norm_eps=float(get(row.eps_key)),
        block=row.block, qk_norm=row.qk_norm, ffn=ACTIVATIONS[act], use_bias=use_bias,
        qkv_bias=qkv_bias, tie_embeddings=bool(get("tie_word_embeddings")))
    fields.update(layer_fields(hf, get, row, ropes))
    if row.moe is not None:
        fields["moe"] = read_moe(hf, get, row)
    if row.mla:  # per-head keys from the latent; head_dim is the query/key width
        fields["mla"], scale = read_mla(hf, get)
        fields.update(n_kv_heads=None, head_dim=None, attn_scale=scale)
    fields.update(row.extra(get))
    return ModelConfig(**fields)


def write_config(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of a Llama-layout model type; what the type cannot say is caught
    by the round trip of jaxformer.convert.hf_config."""
    acts = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}  # others show in the round trip
    out = dict(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
               attention_dropout=0.0, initializer_range=0.02)
    out[row.act_key] = acts.get(cfg.ffn, "silu")
    out[row.eps_key] = cfg.norm_eps
    if row.biases == "attention_and_mlp":
        out.update(attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias)
    elif row.biases in ("attention", "attention_no_mlp"):
        out.update(attention_bias=cfg.use_bias)
    elif row.biases == "qkv_bias":
        out.update(qkv_bias=cfg.qkv_bias)
    out.update(layers_to_hf(cfg, row))
    if row.moe is not None:
        out.update(write_moe(cfg, row))
    if row.mla:
        out.update(write_mla(cfg))
    if not row.rope_per_type:
        rope = _one_rope(cfg) if not row.mla else mla_rope(cfg, _one_rope(cfg))
        if row.rotary_fraction_key is not None:
            rope["partial_rotary_factor"] = cfg.rope_fraction
        out.update(rope_parameters=rope, rope_theta=rope["rope_theta"],
                   rope_scaling=None if rope["rope_type"] == "default" else
                   {k: v for k, v in rope.items() if k != "rope_theta"})
    else:
        out.update(rope_parameters=rope_per_type_to_hf(cfg))
    out.update(row.extra_to_hf(cfg))
    return out


def _one_rope(cfg: ModelConfig) -> dict:
    """The RoPE of the model's rotated layers, which must be one."""
    rotated = {(k.rope_theta, k.rope_scaling) for k in cfg.kinds if k.rope}
    if len(rotated) > 1:
        raise cannot("layer_kinds", "several RoPE bases", "this family has one RoPE for "
                     "every layer")
    theta, scaling = rotated.pop() if rotated else (cfg.rope_theta, cfg.rope_scaling)
    return rope_dict(theta, scaling)


# ---- tensors ----------------------------------------------------------------------


# our norm -> its HF tensor (under model.layers.N.), per model.block
NORM_TENSORS = {
    "pre_ln": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "parallel_shared_ln": {"attn_norm": "input_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm",
                 "ffn_post_norm": "post_feedforward_layernorm"},
    "res_post_ln": {"attn_post_norm": "post_attention_layernorm",
                    "ffn_post_norm": "post_feedforward_layernorm"},
}


def tensor_rules(cfg: ModelConfig, row, rope_layout: str = "half") -> list[Rule]:
    """The Llama layout and its lineage: norms named per block (NORM_TENSORS), QK-norm
    weights, fused projections (row.fused_projections). rope_layout="interleaved": the
    checkpoint's q/k weights (and biases, QK-norm weights) rotate interleaved pairs (of a
    head's rotated dimensions, rope_fraction's first); they
    are permuted to half rotation on load and back on save (a model type whose own layout
    is interleaved, row.rope_layout, always is)."""
    d, n, h, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.vocab_size
    rope = rope_permutation(rope_layout if row.rope_layout == "half" else row.rope_layout,
                            rotary_dims(h, cfg.rope_fraction))
    t = row.tensor_prefix
    rules = [copied(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        if cfg.mla.on:
            rules += mla_rules(cfg, (b, "attn"), f"{p}self_attn.")
        else:
            rules += _attention(cfg, (b, "attn"), f"{p}self_attn.", rope, row.fused_projections)
            rules.append(linear((b, "attn", "out", "kernel"), f"{p}self_attn.o_proj.weight",
                                (d, n * h), (n, h, d)))
        if cfg.attn_sinks:
            rules.append(copied((b, "attn", "sinks"), f"{p}self_attn.sinks", (n,)))
        for ours, hf in NORM_TENSORS[cfg.block].items():
            rules.append(copied((b, ours, "scale"), f"{p}{hf}.weight", (d,)))
            if not NORMS[cfg.norm].rms and cfg.use_bias:  # LayerNorm's bias
                rules.append(copied((b, ours, "bias"), f"{p}{hf}.bias", (d,)))
        sparse = cfg.sparse_layers[i]
        rules += moe_rules(cfg, row, b, p) if sparse else \
            _mlp(cfg, (b, "ffn"), f"{p}mlp.", row.fused_projections)
        if cfg.use_bias:
            rules.append(copied((b, "attn", "out", "bias"), f"{p}self_attn.o_proj.bias", (d,)))
            rules += [copied((b, "ffn", ours, "bias"), f"{p}mlp.{hf}.bias", shape[:1])
                      for ours, hf, shape in _mlp_shapes(cfg) if not sparse]
    rules.append(copied(("final_norm", "scale"), f"{t}norm.weight", (d,)))
    if not NORMS[cfg.norm].rms and cfg.use_bias:
        rules.append(copied(("final_norm", "bias"), f"{t}norm.bias", (d,)))
    if not cfg.tie_embeddings:
        rules.append(linear(("lm_head", "kernel"), row.head_tensor, (v, d), (d, v)))
    return rules


def _mlp_shapes(cfg: ModelConfig):
    """(our kernel, HF projection, HF weight shape) of the MLP."""
    d, f = cfg.d_model, cfg.d_ff
    return (("wi_gate", "gate_proj", (f, d)), ("wi_up", "up_proj", (f, d)),
            ("wo", "down_proj", (d, f)))


def _mlp(cfg: ModelConfig, m: Path, p: str, fused: bool) -> list[Rule]:
    """gate, up and down projections (gate|up fused for Phi-3)."""
    d, f = cfg.d_model, cfg.d_ff
    if fused:
        return [split_rows(m, ("wi_gate", "wi_up"), f"{p}gate_up_proj.weight", (f, f), d,
                           ((d, f), (d, f))),
                linear(m + ("wo", "kernel"), f"{p}down_proj.weight", (d, f), (f, d))]
    return [linear(m + (ours, "kernel"), f"{p}{hf}.weight", shape, shape[::-1])
            for ours, hf, shape in _mlp_shapes(cfg)]


def _attention(cfg: ModelConfig, a: Path, p: str, rope, fused: bool) -> list[Rule]:
    """q/k/v projections (fused for Phi-3), their biases, and the QK-norm weights."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = (("query", "q_proj", n, rope), ("key", "k_proj", k, rope), ("value", "v_proj", k, None))
    rules = []
    if fused:
        rules.append(split_rows(a, ("query", "key", "value"), f"{p}qkv_proj.weight",
                                (n * h, k * h, k * h), d, ((d, n, h), (d, k, h), (d, k, h))))
    else:
        rules += [linear(a + (ours, "kernel"), f"{p}{hf}.weight", (m * h, d), (d, m, h), post)
                  for ours, hf, m, post in heads]
    if cfg.qkv_bias:
        rules += [reshaped(a + (ours, "bias"), f"{p}{hf}.bias", (m * h,), (m, h), post)
                  for ours, hf, m, post in heads]
    qk_axes = QK_NORMS[cfg.qk_norm].query_axes
    if qk_axes is not None and len(qk_axes) == 1:  # per head, over head_dim
        rules += [reshaped(a + (x, "scale"), f"{p}{x}.weight", (h,), (h,), rope)
                  for x in ("q_norm", "k_norm")]
    elif qk_axes is not None:  # over the whole projection
        rules += [reshaped(a + (x, "scale"), f"{p}{x}.weight", (m * h,), (m, h), rope)
                  for x, m in (("q_norm", n), ("k_norm", k))]
    return rules
