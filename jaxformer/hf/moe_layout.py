"""The mixture of experts of a Llama-layout family (its row's `moe`, jaxformer.hf.families):
config.json keys <-> model.moe (jaxformer.moe.experts.MoEConfig), and the tensor rules of a sparse
layer's feed-forward network.

A family stores its experts one of two ways (transformers 5 fuses them in memory, but
save_pretrained writes, and the Hub holds, these):
  per expert: {block}.experts.j.{gate, up, down}.weight, Linear weights [F, D], [F, D],
    [D, F] (Mixtral's w1, w3, w2; the Qwen-MoE and OLMoE families' gate_proj, up_proj,
    down_proj);
  stacked (Granite-MoE): {block}.input_linear.weight [E, 2F, D] (gate rows, then up) and
    output_linear.weight [E, D, F];
  fused (gpt-oss): {block}.experts.gate_up_proj [E, D, 2F] (in, out: gate and up
    columns interleaved, gate first) and down_proj [E, F, D], with their biases
    gate_up_proj_bias [E, 2F] (interleaved) and down_proj_bias [E, D], and the router's.
Ours (jaxformer.model.blocks.MoEFeedForward): router/kernel [D, E], wi_gate / wi_up [E, D, F],
wo [E, F, D] (and {name}_bias [E, out], router/bias [E] with model.moe.bias); the shared
expert's shared/{wi_gate, wi_up, wo}/kernel and shared_gate/kernel [D, 1].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxformer.hf.rope import cannot, unsupported
from jaxformer.hf.tensors import Path, Rule, copied, linear
from jaxformer.model.config import ModelConfig
from jaxformer.moe.experts import ROUTERS, MoEConfig


@dataclasses.dataclass(frozen=True)
class MoEFormat:
    """A family's mixture of experts.

    config.json. experts_keys: the expert count's keys, the first written (the others are
      aliases its config class maps onto it). router: the jaxformer.moe.experts.ROUTERS row that
      routes as the family; norm_topk_key: the key that renormalises the chosen weights
      (None: the router row decides). expert_d_ff_key: each expert's width (None: it is
      intermediate_size, and every layer is sparse). sparse_layers: mlp_only_layers and
      decoder_sparse_step choose the sparse layers, the others a dense MLP of width
      intermediate_size (Qwen-MoE). shared_expert: one shared expert of width
      shared_expert_intermediate_size, its output times sigmoid(shared_expert_gate x)
      (Qwen2-MoE). first_dense_key: the layers before this key's count are dense, the rest
      sparse (DeepSeek's first_k_dense_replace). shared_count_key: that many shared experts
      of each expert's width, ungated, under shared_experts (DeepSeek). groups: (get) ->
      (groups, topk_groups) of group-limited routing, and groups_to_hf its keys;
      scale_key: the routed output's factor (routed_scaling_factor). dense_too: the
      family also ships dense models (Nemotron-H, Granite 4), written by its row.
      shared_mlp: one ungated shared expert of each expert's width in every sparse layer,
      under this name (Hunyuan's shared_mlp).
    Tensors, under model.layers.N.{block}. router_tensor: the router's Linear
      (with the sigmoid router, its .e_score_correction_bias is the selection bias);
      expert_tensors: the gate, up and down projections of each expert j under
      experts.j; stacked: (gate|up, down) stacked over the experts instead; fused:
      (gate|up interleaved, down) under experts, as kernels. biases: the router and the
      experts have biases (model.moe.bias; fused only).
    """

    block: str
    router_tensor: str
    experts_keys: tuple[str, ...]
    router: str
    norm_topk_key: str | None = None
    expert_d_ff_key: str | None = None
    sparse_layers: bool = False
    shared_expert: bool = False
    expert_tensors: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked: tuple[str, str] | None = None
    fused: tuple[str, str] | None = None
    biases: bool = False
    first_dense_key: str | None = None
    shared_count_key: str | None = None
    groups: Any = None
    groups_to_hf: Any = None
    scale_key: str | None = None
    dense_too: bool = False
    shared_mlp: str | None = None


# ---- config.json ----------------------------------------------------------------------


def _expert_count(hf, get, row) -> int:
    """The number of experts, under its key or an alias (one value if both are there)."""
    keys = row.moe.experts_keys
    found = {k: hf[k] for k in keys if k in hf}
    if len(set(found.values())) > 1:
        raise unsupported(", ".join(found), list(found.values()), f"{row.name}'s expert "
                          "count is one number under either key")
    return found.popitem()[1] if found else get(keys[0])


def _sparse_layers(get, row, n_layers: int) -> tuple[int, ...] | None:
    """The sparse layers (None: all): those not in mlp_only_layers whose number (i + 1)
    decoder_sparse_step divides, as transformers' Qwen-MoE decoder layer chooses; or those
    from first_k_dense_replace on (DeepSeek)."""
    if row.moe.first_dense_key:
        first = get(row.moe.first_dense_key) or 0
        return tuple(range(first, n_layers)) if first else None
    if not row.moe.sparse_layers:
        return None
    step, dense = get("decoder_sparse_step"), set(get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1:
        raise unsupported("decoder_sparse_step", step, "it must be a positive integer")
    sparse = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    return None if len(sparse) == n_layers else sparse


def read_moe(hf, get, row) -> MoEConfig:
    """model.moe of a family's config.json (no experts: every layer dense)."""
    f = row.moe
    experts = _expert_count(hf, get, row)
    if not experts:
        return MoEConfig()
    top_k = get("num_experts_per_tok")
    # transformers adds router_aux_loss_coef * load_balancing_loss_func to the loss only
    # with output_router_logits. Its loss is E sum_e f_e p_e with f_e the share of tokens
    # (not of assignments) reaching expert e, so top_k at balance: top_k times ours
    # (jaxformer.moe.experts.balance_losses, 1 at balance). The coefficient times top_k is the same
    # penalty per layer; transformers pools f and p over the layers before the product,
    # ours is per layer (equal when the layers route alike).
    aux = float(get("router_aux_loss_coef")) * top_k if get("output_router_logits") else 0.0
    shared = int(f.shared_expert or bool(f.shared_mlp)) if f.shared_count_key is None else \
        get(f.shared_count_key) or 0
    groups, topk_groups = f.groups(get) if f.groups else (1, 1)
    return MoEConfig(
        experts=experts, top_k=top_k, router=f.router,
        norm_topk=bool(get(f.norm_topk_key)) if f.norm_topk_key else False,
        d_ff=get(f.expert_d_ff_key) if f.expert_d_ff_key else None,
        shared_experts=shared, shared_gate=f.shared_expert,
        shared_d_ff=get("shared_expert_intermediate_size") if f.shared_expert else None,
        layers=_sparse_layers(get, row, get("num_hidden_layers")), aux_loss=aux, bias=f.biases,
        groups=groups, topk_groups=topk_groups,
        routed_scale=float(get(f.scale_key)) if f.scale_key else 1.0)


def write_moe(cfg: ModelConfig, row) -> dict[str, Any]:
    """config.json keys of model.moe in a family; what the family cannot say (a router of
    its own, biases, groups) is caught by the round trip of jaxformer.convert.hf_config."""
    m, f = cfg.moe, row.moe
    if not m.experts:
        raise cannot("moe.experts", 0, f"a {row.name} model is a mixture of experts")
    if f.shared_expert and not m.shared_experts:
        raise cannot("moe.shared_experts", 0, f"{row.name}'s sparse layers have a shared expert")
    normalise = ROUTERS[m.router].normalise
    out: dict[str, Any] = {
        f.experts_keys[0]: m.experts, "num_experts_per_tok": m.top_k,
        f.expert_d_ff_key or "intermediate_size": cfg.expert_d_ff,
        "output_router_logits": m.aux_loss > 0,  # read_moe: the same penalty
        "router_aux_loss_coef": m.aux_loss / m.top_k if m.aux_loss > 0 else
        row.defaults["router_aux_loss_coef"]}
    if f.norm_topk_key:
        out[f.norm_topk_key] = m.norm_topk if normalise is None else normalise
    if f.sparse_layers:
        out.update(mlp_only_layers=[i for i, s in enumerate(cfg.sparse_layers) if not s],
                   decoder_sparse_step=1)
    if f.shared_expert:
        out["shared_expert_intermediate_size"] = cfg.shared_d_ff
    if f.shared_count_key:  # of each expert's width: the round trip catches another width
        out[f.shared_count_key] = m.shared_experts
    if f.first_dense_key:  # the dense layers first: the round trip catches another order
        out[f.first_dense_key] = cfg.sparse_layers.index(True) if any(cfg.sparse_layers) else 0
    if f.groups_to_hf:
        out.update(f.groups_to_hf(m))
    if f.scale_key:
        out[f.scale_key] = m.routed_scale
    return out


# ---- tensors --------------------------------------------------------------------------


def _per_expert(path: Path, names: list[str], hf_shape) -> Rule:
    """E Linear weights [out, in] <-> one kernel [E, in, out]."""
    return Rule((path,), tuple(names), (tuple(hf_shape),) * len(names),
                lambda *ws: (np.stack([w.T for w in ws]),),
                lambda k: tuple(x.T for x in k))


def _stacked(m: Path, hf: tuple[str, str], e: int, d: int, f: int) -> list[Rule]:
    """gate|up [E, 2F, D] <-> wi_gate, wi_up [E, D, F]; down [E, D, F] <-> wo [E, F, D]."""
    gate_up = Rule((m + ("wi_gate",), m + ("wi_up",)), (hf[0],), ((e, 2 * f, d),),
                   lambda w: (w[:, :f].transpose(0, 2, 1), w[:, f:].transpose(0, 2, 1)),
                   lambda g, u: (np.concatenate([g.transpose(0, 2, 1),
                                                 u.transpose(0, 2, 1)], axis=1),))
    down = Rule((m + ("wo",),), (hf[1],), ((e, d, f),), lambda w: (w.transpose(0, 2, 1),),
                lambda k: (k.transpose(0, 2, 1),))
    return [gate_up, down]


def _fused(m: Path, p: str, hf: tuple[str, str], e: int, d: int, f: int) -> list[Rule]:
    """gate|up [E, D, 2F] (columns interleaved) <-> wi_gate, wi_up [E, D, F]; down
    [E, F, D] <-> wo; their biases likewise."""
    def interleaved(ours, name, shape):  # shape: HF's, its last axis 2F
        return Rule(tuple(m + (o,) for o in ours), (name,), (shape,),
                    lambda w: (w[..., ::2], w[..., 1::2]),
                    lambda g, u: (np.stack([g, u], axis=-1).reshape(shape),))
    return [interleaved(("wi_gate", "wi_up"), f"{p}experts.{hf[0]}", (e, d, 2 * f)),
            interleaved(("wi_gate_bias", "wi_up_bias"), f"{p}experts.{hf[0]}_bias", (e, 2 * f)),
            copied(m + ("wo",), f"{p}experts.{hf[1]}", (e, f, d)),
            copied(m + ("wo_bias",), f"{p}experts.{hf[1]}_bias", (e, d))]


def moe_rules(cfg: ModelConfig, row, block: str, prefix: str) -> list[Rule]:
    """The rules of a sparse layer's feed-forward network: block_i/ffn <-> the family's
    names under `prefix` (model.layers.i.)."""
    f, d, e, ff = row.moe, cfg.d_model, cfg.moe.experts, cfg.expert_d_ff
    m, p = (block, "ffn"), f"{prefix}{f.block}."
    rules = [linear(m + ("router", "kernel"), f"{p}{f.router_tensor}.weight", (e, d), (d, e))]
    if cfg.moe.has_score_bias:
        rules.append(copied(m + ("score_bias",), f"{p}{f.router_tensor}.e_score_correction_bias",
                            (e,)))
    if f.biases:
        rules.append(copied(m + ("router", "bias"), f"{p}{f.router_tensor}.bias", (e,)))
    if f.fused:
        rules += _fused(m, p, f.fused, e, d, ff)
    elif f.stacked:
        rules += _stacked(m, tuple(f"{p}{n}.weight" for n in f.stacked), e, d, ff)
    else:
        for ours, hf, shape in zip(("wi_gate", "wi_up", "wo"), f.expert_tensors,
                                   ((ff, d), (ff, d), (d, ff))):
            rules.append(_per_expert(m + (ours,), [f"{p}experts.{j}.{hf}.weight"
                                                   for j in range(e)], shape))
    if cfg.shared_d_ff:
        s = cfg.shared_d_ff
        name = f.shared_mlp or ("shared_expert" if f.shared_expert else "shared_experts")
        rules += [linear(m + ("shared", ours, "kernel"), f"{p}{name}.{hf}.weight",
                         shape, shape[::-1]) for ours, hf, shape in
                  (("wi_gate", "gate_proj", (s, d)), ("wi_up", "up_proj", (s, d)),
                   ("wo", "down_proj", (d, s)))]
    if f.shared_expert:
        rules.append(linear(m + ("shared_gate", "kernel"), f"{p}shared_expert_gate.weight",
                            (1, d), (d, 1)))
    return rules
