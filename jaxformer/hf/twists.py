"""The families' twists as functions and shared settings, which the rows of
jaxformer.hf.families point at: how a model type picks each layer's type when config.json
lists none, what a writer adds, DeepSeek's group routing keys."""

from __future__ import annotations

from jaxformer.hf.rope import cannot, unsupported
from jaxformer.positions.schemes import POSITION_SCHEMES

# ---- layer types, when config.json lists none -----------------------------------------


def all_sliding(get, i):  # Mistral, Phi-3: one window for every layer, when set
    return "full_attention" if get("sliding_window") is None else "sliding_attention"


def qwen_types(get, i):  # transformers' rule: layers from max_window_layers on slide
    slide = get("use_sliding_window") and get("sliding_window") is not None
    return "sliding_attention" if slide and i >= get("max_window_layers") else "full_attention"


def global_every(n: int, key: str | None = None):
    """Sliding layers, but every n-th (i + 1 divisible by n; n read from `key` where the
    model type has one) global."""
    return lambda get, i: ("full_attention" if (i + 1) % ((get(key) if key else None) or n) == 0
                           else "sliding_attention")


def sliding_if_used(get, i):  # Qwen3-MoE: every layer slides under use_sliding_window
    slide = get("use_sliding_window") and get("sliding_window") is not None
    return "sliding_attention" if slide else "full_attention"


def qwen2_moe_types(get, i):  # transformers 5: layers i + 1 odd below max_window_layers
    slide = get("use_sliding_window") and i < get("max_window_layers") and (i + 1) % 2
    return "sliding_attention" if slide else "full_attention"


def olmoe_to_hf(cfg) -> dict:  # its q_norm / k_norm span hidden_size / n_heads per head
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise cannot("head_dim", cfg.head_dim, "OLMoE's heads are hidden_size / "
                     "num_attention_heads wide (its QK-norm weights have that size)")
    return {}


def smollm3_rope(get, i, layer_type=None) -> bool:  # no_rope_layers: 1 where rotated
    layers = get("no_rope_layers")
    if layers is None:
        return bool((i + 1) % get("no_rope_layer_interval"))
    return bool(layers[i])


def smollm3_types(get, i):  # sliding only where use_sliding_window, and a NoPE layer
    slide = get("use_sliding_window") and get("sliding_window") is not None
    return "sliding_attention" if slide and not smollm3_rope(get, i) else "full_attention"


def smollm3_to_hf(cfg) -> dict:
    rotary = POSITION_SCHEMES[cfg.position].kind == "rotary"
    return dict(no_rope_layers=[int(cfg.kinds[i].rope and rotary) for i in cfg.layer_kind_ids])


def sliding_rotated(get, i, layer_type) -> bool:  # the global layers are NoPE
    return layer_type == "sliding_attention"


NO_BIDIRECTIONAL = (("use_bidirectional_attention", (None, False), "jaxformer's attention "
                      "is causal"),)
GEMMA = dict(norm="rmsnorm_offset", biases="attention", refuse=NO_BIDIRECTIONAL)
ROUTER_LOSS = dict(output_router_logits=False, router_aux_loss_coef=0.001)
DEEPSEEK = dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                 rope_theta=10000.0, head_dim=None, pretraining_tp=1, **ROUTER_LOSS)
DEEPSEEK_REFUSE = (("attention_bias", (False,), "jaxformer's MLA projections have no biases"),
                    ("pretraining_tp", (1, None), "it is a tensor-parallel setting of another "
                     "library; re-save with pretraining_tp 1"))


def v2_groups(get):  # topk_method: greedy, or group_limited_greedy over n_group groups
    method = get("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise unsupported("topk_method", method, "DeepSeek-V2 routes greedy or "
                          "group_limited_greedy")
    return (get("n_group"), get("topk_group")) if method != "greedy" else (1, 1)


def v2_groups_to_hf(m) -> dict:
    return dict(topk_method="group_limited_greedy" if m.groups > 1 else "greedy",
                n_group=m.groups, topk_group=m.topk_groups)

