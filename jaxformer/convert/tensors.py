"""Which Hugging Face tensors hold which jaxformer params, and the exact reshapes between them.

A ``Rule`` ties a group of HF tensors to a group of our params with a function each way, so
loading and saving are one table read in two directions (and a round trip is exact: only
transposes, reshapes, splits and concatenations). Names are those of the ``*ForCausalLM`` /
``GPT2LMHeadModel`` checkpoints; a bare-model checkpoint lacks the ``model.`` /
``transformer.`` prefix, which the reader allows.

Our layout (jaxformer.model): embed/embedding [V, D]; per block attn/{query [D, N, H],
key/value [D, K, H], out [N, H, D]} kernels, q/k/v biases [N|K, H]; ffn/{wi | wi_gate,
wi_up} [D, F], wo [F, D]; norms' scale (and LayerNorm bias) [D]; lm_head/kernel [D, V].
HF Linear weights are [out, in]; GPT-2's Conv1D weights are [in, out] with q|k|v fused;
GPT-NeoX's query_key_value is a Linear whose output axis is [n_heads, 3 (q, k, v), head_dim].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxformer.config import ModelConfig

Path = tuple[str, ...]
PREFIX = {"gpt2": "transformer.", "llama": "model.", "gpt_neox": "gpt_neox."}
HEAD = {"gpt2": "lm_head.weight", "llama": "lm_head.weight", "gpt_neox": "embed_out.weight"}
# HF buffers that are not params (causal-mask and RoPE tables of older checkpoints).
IGNORED = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",
           r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
           r"(gpt_neox\.)?layers\.\d+\.attention\.((masked_)?bias|rotary_emb\.inv_freq)",
           r"(model\.)?rotary_emb\.\w*inv_freq", r"(model\.)?embed_tokens\.embed_scale")
ROPE_LAYOUTS = ("half", "interleaved")


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: tuple[Path, ...]                     # param paths
    hf: tuple[str, ...]                        # HF tensor names
    hf_shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[..., tuple[np.ndarray, ...]]  # HF arrays -> our arrays
    to_hf: Callable[..., tuple[np.ndarray, ...]]    # our arrays -> HF arrays


def permute_interleaved_to_half(x):
    """RoPE layout of the last (head_dim) axis: interleaved pairs (2i, 2i+1), as Meta's
    original Llama checkpoints, -> half rotation (i, i + head_dim/2), as HF and jaxformer.
    This is the permutation of transformers' convert_llama_weights_to_hf."""
    h = x.shape[-1]
    return x.reshape(*x.shape[:-1], h // 2, 2).swapaxes(-1, -2).reshape(x.shape)


def permute_half_to_interleaved(x):
    """The inverse of permute_interleaved_to_half."""
    h = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, h // 2).swapaxes(-1, -2).reshape(x.shape)


def _one(path: Path, name: str, hf_shape, to_ours, to_hf) -> Rule:
    return Rule((path,), (name,), (tuple(hf_shape),), lambda w: (to_ours(w),),
                lambda k: (to_hf(k),))


def _copy(path: Path, name: str, shape) -> Rule:
    return _one(path, name, shape, lambda w: w, lambda k: k)


def _reshaped(path: Path, name: str, hf_shape, shape, post=None) -> Rule:
    """Same element order, another shape (Conv1D kernels, biases); `post` (an involution
    pair (to_ours, to_hf)) permutes the last axis of ours afterwards."""
    fwd, inv = post or (lambda x: x, lambda x: x)
    return _one(path, name, hf_shape, lambda w: fwd(w.reshape(shape)),
                lambda k: inv(k).reshape(hf_shape))


def _linear(path: Path, name: str, hf_shape, shape, post=None) -> Rule:
    """torch Linear weight [out, in] -> kernel [in, out] reshaped to `shape`."""
    fwd, inv = post or (lambda x: x, lambda x: x)
    return _one(path, name, hf_shape, lambda w: fwd(w.T.reshape(shape)),
                lambda k: inv(k).reshape(hf_shape[::-1]).T)


def gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    d, n, h, f, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    t = PREFIX["gpt2"]
    rules = [_copy(("embed", "embedding"), f"{t}wte.weight", (v, d)),
             _copy(("pos_embed", "embedding"), f"{t}wpe.weight", (cfg.max_seq_len, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}h.{i}."
        attn = [(b, "attn", x) for x in ("query", "key", "value")]
        rules += [
            _copy((b, "attn_norm", "scale"), f"{p}ln_1.weight", (d,)),
            _copy((b, "attn_norm", "bias"), f"{p}ln_1.bias", (d,)),
            Rule(tuple(a + ("kernel",) for a in attn), (f"{p}attn.c_attn.weight",), ((d, 3 * d),),
                 lambda w: tuple(x.reshape(d, n, h) for x in np.split(w, 3, axis=1)),
                 lambda *qkv: (np.concatenate([x.reshape(d, d) for x in qkv], axis=1),)),
            Rule(tuple(a + ("bias",) for a in attn), (f"{p}attn.c_attn.bias",), ((3 * d,),),
                 lambda w: tuple(x.reshape(n, h) for x in np.split(w, 3)),
                 lambda *qkv: (np.concatenate([x.reshape(d) for x in qkv]),)),
            _reshaped((b, "attn", "out", "kernel"), f"{p}attn.c_proj.weight", (d, d), (n, h, d)),
            _copy((b, "attn", "out", "bias"), f"{p}attn.c_proj.bias", (d,)),
            _copy((b, "ffn_norm", "scale"), f"{p}ln_2.weight", (d,)),
            _copy((b, "ffn_norm", "bias"), f"{p}ln_2.bias", (d,)),
            _copy((b, "ffn", "wi", "kernel"), f"{p}mlp.c_fc.weight", (d, f)),
            _copy((b, "ffn", "wi", "bias"), f"{p}mlp.c_fc.bias", (f,)),
            _copy((b, "ffn", "wo", "kernel"), f"{p}mlp.c_proj.weight", (f, d)),
            _copy((b, "ffn", "wo", "bias"), f"{p}mlp.c_proj.bias", (d,)),
        ]
    rules += [_copy(("final_norm", "scale"), f"{t}ln_f.weight", (d,)),
              _copy(("final_norm", "bias"), f"{t}ln_f.bias", (d,))]
    if not cfg.tie_embeddings:
        rules.append(_linear(("lm_head", "kernel"), "lm_head.weight", (v, d), (d, v)))
    return rules


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
FUSED = {"phi3"}  # q|k|v in one qkv_proj, gate|up in one gate_up_proj
NATIVE_ROPE_LAYOUT = {"cohere2": "interleaved"}  # rotates adjacent pairs (2i, 2i+1)


def _split_rows(block_path, names, hf_name, sizes, d, shapes) -> Rule:
    """One fused Linear [sum(sizes), D] <-> kernels [D, size] reshaped to `shapes`."""
    cuts = list(np.cumsum(sizes)[:-1])
    return Rule(tuple(block_path + (n, "kernel") for n in names), (hf_name,), ((sum(sizes), d),),
                lambda w: tuple(x.T.reshape(shape) for x, shape in
                                zip(np.split(w, cuts, axis=0), shapes)),
                lambda *ks: (np.concatenate([k.reshape(d, -1).T for k in ks], axis=0),))


def llama_rules(cfg: ModelConfig, rope_layout: str = "half", model_type: str = "llama"
                ) -> list[Rule]:
    """The Llama layout and its lineage: norms named per block (NORM_TENSORS), QK-norm
    weights, Phi-3's fused projections. rope_layout="interleaved": the checkpoint's q/k
    weights (and biases, QK-norm weights) rotate interleaved pairs; they are permuted to
    half rotation on load and back on save."""
    d, n, k, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
    rope = _rope_permutation(NATIVE_ROPE_LAYOUT.get(model_type, rope_layout))
    t = PREFIX["llama"]
    rules = [_copy(("embed", "embedding"), f"{t}embed_tokens.weight", (v, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += _llama_attention(cfg, (b, "attn"), f"{p}self_attn.", rope, model_type)
        rules.append(_linear((b, "attn", "out", "kernel"), f"{p}self_attn.o_proj.weight",
                             (d, n * h), (n, h, d)))
        for ours, hf in NORM_TENSORS[cfg.block].items():
            rules.append(_copy((b, ours, "scale"), f"{p}{hf}.weight", (d,)))
            if cfg.norm == "layernorm" and cfg.use_bias:
                rules.append(_copy((b, ours, "bias"), f"{p}{hf}.bias", (d,)))
        mlp = (("wi_gate", "gate_proj", (f, d)), ("wi_up", "up_proj", (f, d)),
               ("wo", "down_proj", (d, f)))
        if model_type in FUSED:
            rules.append(_split_rows((b, "ffn"), ("wi_gate", "wi_up"), f"{p}mlp.gate_up_proj.weight",
                                     (f, f), d, ((d, f), (d, f))))
            rules.append(_linear((b, "ffn", "wo", "kernel"), f"{p}mlp.down_proj.weight", (d, f),
                                 (f, d)))
        else:
            rules += [_linear((b, "ffn", ours, "kernel"), f"{p}mlp.{hf}.weight", shape,
                              shape[::-1]) for ours, hf, shape in mlp]
        if cfg.use_bias:
            rules.append(_copy((b, "attn", "out", "bias"), f"{p}self_attn.o_proj.bias", (d,)))
            rules += [_copy((b, "ffn", ours, "bias"), f"{p}mlp.{hf}.bias", shape[:1])
                      for ours, hf, shape in mlp]
    rules.append(_copy(("final_norm", "scale"), f"{t}norm.weight", (d,)))
    if cfg.norm == "layernorm" and cfg.use_bias:
        rules.append(_copy(("final_norm", "bias"), f"{t}norm.bias", (d,)))
    if not cfg.tie_embeddings:
        rules.append(_linear(("lm_head", "kernel"), "lm_head.weight", (v, d), (d, v)))
    return rules


def _llama_attention(cfg: ModelConfig, a: Path, p: str, rope, model_type: str) -> list[Rule]:
    """q/k/v projections (fused for Phi-3), their biases, and the QK-norm weights."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = (("query", "q_proj", n, rope), ("key", "k_proj", k, rope), ("value", "v_proj", k, None))
    rules = []
    if model_type in FUSED:
        rules.append(_split_rows(a, ("query", "key", "value"), f"{p}qkv_proj.weight",
                                 (n * h, k * h, k * h), d, ((d, n, h), (d, k, h), (d, k, h))))
    else:
        rules += [_linear(a + (ours, "kernel"), f"{p}{hf}.weight", (m * h, d), (d, m, h), post)
                  for ours, hf, m, post in heads]
    if cfg.qkv_bias:
        rules += [_reshaped(a + (ours, "bias"), f"{p}{hf}.bias", (m * h,), (m, h), post)
                  for ours, hf, m, post in heads]
    if cfg.qk_norm == "head":
        rules += [_reshaped(a + (x, "scale"), f"{p}{x}.weight", (h,), (h,), rope)
                  for x in ("q_norm", "k_norm")]
    elif cfg.qk_norm == "projection":
        rules += [_reshaped(a + (x, "scale"), f"{p}{x}.weight", (m * h,), (m, h), rope)
                  for x, m in (("q_norm", n), ("k_norm", k))]
    return rules


def _rope_permutation(rope_layout: str):
    """(to_ours, to_hf) of the q/k last axis for a checkpoint's RoPE layout; None for half."""
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope_layout={rope_layout!r} is not one of {', '.join(ROPE_LAYOUTS)}")
    if rope_layout == "interleaved":
        return permute_interleaved_to_half, permute_half_to_interleaved
    return None


def _fused_qkv(block: str, name: str, cfg: ModelConfig, rope) -> Rule:
    """GPT-NeoX's query_key_value weight [3 N H, D] or bias [3 N H], its output axis
    [N, 3, H] (per head q, k, v), <-> query/key/value kernels [D, N, H] or biases [N, H];
    `rope` permutes q and k as in llama_rules."""
    n, h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    weight = name.endswith(".weight")
    keep = (lambda x: x, lambda x: x)
    posts = (rope or keep, rope or keep, keep)

    def to_ours(w):
        w = w.T.reshape(d, n, 3, h) if weight else w.reshape(n, 3, h)
        return tuple(fwd(w[..., j, :]) for j, (fwd, _) in enumerate(posts))

    def to_hf(*qkv):
        w = np.stack([inv(x) for x, (_, inv) in zip(qkv, posts)], axis=-2)
        return (w.reshape(d, 3 * n * h).T,) if weight else (w.reshape(3 * n * h),)

    leaf = "kernel" if weight else "bias"
    return Rule(tuple((block, "attn", x, leaf) for x in ("query", "key", "value")), (name,),
                ((3 * n * h, d) if weight else (3 * n * h,),), to_ours, to_hf)


def neox_rules(cfg: ModelConfig, rope_layout: str = "half") -> list[Rule]:
    """GPT-NeoX (sequential residual, full rotary): LayerNorms and every linear with
    biases, fused q|k|v per head, an untied head named embed_out."""
    d, n, h, f, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    rope = _rope_permutation(rope_layout)
    t = PREFIX["gpt_neox"]
    rules = [_copy(("embed", "embedding"), f"{t}embed_in.weight", (v, d))]
    for i in range(cfg.n_layers):
        b, p = f"block_{i}", f"{t}layers.{i}."
        rules += [_fused_qkv(b, f"{p}attention.query_key_value.{x}", cfg, rope)
                  for x in ("weight", "bias")]
        rules += [
            _linear((b, "attn", "out", "kernel"), f"{p}attention.dense.weight", (d, n * h),
                    (n, h, d)),
            _copy((b, "attn", "out", "bias"), f"{p}attention.dense.bias", (d,)),
            _linear((b, "ffn", "wi", "kernel"), f"{p}mlp.dense_h_to_4h.weight", (f, d), (d, f)),
            _copy((b, "ffn", "wi", "bias"), f"{p}mlp.dense_h_to_4h.bias", (f,)),
            _linear((b, "ffn", "wo", "kernel"), f"{p}mlp.dense_4h_to_h.weight", (d, f), (f, d)),
            _copy((b, "ffn", "wo", "bias"), f"{p}mlp.dense_4h_to_h.bias", (d,)),
        ]
        for ours, hf in (("attn_norm", "input_layernorm"),
                         ("ffn_norm", "post_attention_layernorm")):
            rules += [_copy((b, ours, "scale"), f"{p}{hf}.weight", (d,)),
                      _copy((b, ours, "bias"), f"{p}{hf}.bias", (d,))]
    rules += [_copy(("final_norm", "scale"), f"{t}final_layer_norm.weight", (d,)),
              _copy(("final_norm", "bias"), f"{t}final_layer_norm.bias", (d,))]
    if not cfg.tie_embeddings:
        rules.append(_linear(("lm_head", "kernel"), HEAD["gpt_neox"], (v, d), (d, v)))
    return rules


def rules_for(family: str, cfg: ModelConfig, rope_layout: str = "half",
              model_type: str | None = None) -> list[Rule]:
    """The rules of a tensor layout (family); model_type picks a lineage's variant."""
    if family == "gpt2":
        if rope_layout != "half":
            raise ValueError("rope_layout applies to RoPE models; GPT-2 has learned positions")
        return gpt2_rules(cfg)
    if family == "llama":
        return llama_rules(cfg, rope_layout, model_type or "llama")
    return neox_rules(cfg, rope_layout)
