"""Mixture of experts, the math: model.moe (MoEConfig), the routers as a table (ROUTERS),
the dispatches as a table (DISPATCHES: dropless by sort and jax.lax.ragged_dot, a capacity
buffer, the dense reference), and the balancing losses. Pure functions of arrays; the
Flax module that declares the params is jaxformer.model.blocks.MoEFeedForward.

Routing a token x (router logits l = x W_r [+ b_r], float32):
  scores s = router.scores(l)  (softmax, or sigmoid as DeepSeek-V3)
  choice   = s + score_bias    (DeepSeek-V3's correction bias: selection only)
  groups   limit the choice to the topk_groups best of `groups` expert groups
  experts  = top_k(choice);  weights = s[experts], renormalised to sum 1 where the
             router says so (norm_topk; the sum at least norm_min), times routed_scale
  y = sum_j weights_j * expert_{experts_j}(x)  (+ the shared experts; scales_input: expert(w x))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxformer.core.matmul import MATMUL_PRECISIONS, Int8Kernel
from jaxformer.core.validation import ConfigError, Section, check_choice, check_number
from jaxformer.moe.grouped_matmul import grouped_matmul
from jaxformer.moe.grouped_vmap import over_rows

# ---- routers -----------------------------------------------------------------------


def _group_max(s):  # DeepSeek-V2's group_limited_greedy: a group's best expert
    return jnp.max(s, axis=-1)


def _group_top2_sum(s):  # DeepSeek-V3's noaux_tc: the sum of a group's best two
    return jnp.sum(jax.lax.top_k(s, 2)[0], axis=-1)


@dataclasses.dataclass(frozen=True)
class Router:
    """scores(logits) -> per-expert scores (the weights are read from them); group_score:
    a group's score from its experts' (choice) scores, for group-limited selection;
    normalise: the chosen weights renormalised to sum 1 (None: as model.moe.norm_topk);
    score_bias: the model has DeepSeek-V3's selection bias (e_score_correction_bias);
    norm_min: the renormalising sum is clamped at least this (ERNIE 4.5's moe_norm_min)."""

    scores: Callable
    group_score: Callable = _group_max
    normalise: bool | None = None
    score_bias: bool = False
    norm_min: float = 0.0
    scales_input: bool = False  # the weights scale the chosen experts' inputs (Llama 4)


ROUTERS = {
    "softmax_topk": Router(jax.nn.softmax),                   # Qwen-MoE, OLMoE, DeepSeek-V2
    "topk_softmax": Router(jax.nn.softmax, normalise=True),   # Mixtral, GPT-OSS, Granite
    "sigmoid": Router(jax.nn.sigmoid, _group_top2_sum, score_bias=True),  # DeepSeek-V3
    # ERNIE 4.5: softmax, chosen by softmax + bias, w / max(sum w, 1e-12)
    "softmax_bias": Router(jax.nn.softmax, normalise=True, score_bias=True, norm_min=1e-12),
    "sigmoid_input": Router(jax.nn.sigmoid, normalise=False, scales_input=True),  # Llama 4
}


# ---- the config section -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig(Section):
    """model.moe: the sparse feed-forward layers; experts 0: none (every layer dense).

    experts, top_k: routed experts, and how many each token reaches. d_ff: each expert's
    width (None: model.d_ff). shared_experts: experts every token reaches, as one
    feed-forward network of width shared_d_ff (None: shared_experts * d_ff); shared_gate:
    its output times sigmoid(x w) (Qwen2-MoE). router (ROUTERS): softmax_topk, topk_softmax
    (softmax over the chosen: Mixtral), sigmoid (DeepSeek-V3), softmax_bias (softmax, a
    selection bias, renormalised: ERNIE 4.5), sigmoid_input (Llama 4); norm_topk: renormalise
    the chosen weights; groups, topk_groups: the experts in `groups` groups, a token choosing
    only among the topk_groups best; routed_scale: the routed output's factor.
    layers: which layers are sparse (None: all). bias: biases on the router and the experts
    (GPT-OSS).
    capacity_factor: None is dropless (every token reaches its top_k experts); a number
    gives each expert ceil(factor * tokens * top_k / experts) slots, filled with first
    choices before second ones, in token order within a choice; an assignment past them
    is dropped (its token keeps the rest, the residual carries it). It is a training
    option: a token's slot depends on the tokens beside it, so decoding runs dropless
    (jaxformer.decode.cached_forward.decoding_config).
    aux_loss, z_loss: the switch-transformer load-balancing loss (1 at perfect balance)
    and the router z-loss, times these, added to the train loss. bias_update_rate:
    DeepSeek-V3's auxiliary-loss-free balancing: after each step score_bias moves by this
    toward balance (+ for an expert under its mean load, - over), outside the gradient.
    dispatch (DISPATCHES): None is ragged (dropless), or capacity with a capacity_factor;
    dense runs the reference (every expert on every token: E / top_k times the work).
    """

    experts: int = 0
    top_k: int = 2
    d_ff: int | None = None
    shared_experts: int = 0
    shared_d_ff: int | None = None
    shared_gate: bool = False
    router: str = "softmax_topk"
    norm_topk: bool = False
    groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0
    layers: tuple[int, ...] | None = None
    bias: bool = False
    capacity_factor: float | None = None
    aux_loss: float = 0.0
    z_loss: float = 0.0
    bias_update_rate: float = 0.0
    dispatch: str | None = None

    SECTION = "model.moe"

    def __post_init__(self):
        o = self.SECTION
        layers = self.layers
        if isinstance(layers, (str, int)):
            layers = [p for p in str(layers).replace("[", "").replace("]", "").split(",")
                      if p.strip()]
        if layers is not None:
            try:
                layers = tuple(int(i) for i in layers)
            except (TypeError, ValueError):
                raise ConfigError(f"{o}.layers={self.layers!r} must be layer indices, e.g. "
                                  "1,2,3 (or null: every layer)") from None
        object.__setattr__(self, "layers", layers)
        for name in ("experts", "shared_experts"):
            check_number(o, name, getattr(self, name), int, low=0)
        for name in ("top_k", "groups", "topk_groups"):
            check_number(o, name, getattr(self, name), int, low=1)
        for name in ("d_ff", "shared_d_ff"):
            check_number(o, name, getattr(self, name), int, low=1, optional=True)
        check_choice(o, "router", self.router, ROUTERS)
        check_number(o, "routed_scale", self.routed_scale, float, low=0, low_open=True)
        check_number(o, "capacity_factor", self.capacity_factor, float, low=0, low_open=True,
                     optional=True)
        for name in ("aux_loss", "z_loss", "bias_update_rate"):
            check_number(o, name, getattr(self, name), float, low=0)
        for name in ("norm_topk", "shared_gate", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{o}.{name}={getattr(self, name)!r} must be true or false")
        if self.dispatch is not None:
            check_choice(o, "dispatch", self.dispatch, DISPATCHES)
        if (self.dispatch == "capacity") != (self.capacity_factor is not None) and \
                self.dispatch is not None:
            raise ConfigError(f"{o}.dispatch={self.dispatch!r} with capacity_factor="
                              f"{self.capacity_factor}: capacity needs a capacity_factor, and "
                              "only capacity reads one")
        if not self.experts:
            return
        if self.top_k > self.experts:
            raise ConfigError(f"{o}.top_k={self.top_k} exceeds {o}.experts={self.experts}: a "
                              "token cannot reach more experts than there are")
        if self.experts % self.groups:
            raise ConfigError(f"{o}.experts={self.experts} is not divisible by {o}.groups="
                              f"{self.groups}")
        if self.topk_groups > self.groups:
            raise ConfigError(f"{o}.topk_groups={self.topk_groups} exceeds {o}.groups={self.groups}")
        if self.groups > 1 and self.top_k > self.topk_groups * self.experts // self.groups:
            raise ConfigError(f"{o}.top_k={self.top_k} exceeds the experts of the "
                              f"topk_groups={self.topk_groups} groups a token chooses from")
        if self.shared_gate and not self.shared_experts:
            raise ConfigError(f"{o}.shared_gate needs shared experts: set {o}.shared_experts")

    @property
    def row(self) -> Router:
        return ROUTERS[self.router]

    @property
    def has_score_bias(self) -> bool:
        """The router has a selection bias: DeepSeek-V3's, or one that balancing moves."""
        return self.row.score_bias or self.bias_update_rate > 0

    def sparse(self, n_layers: int) -> tuple[bool, ...]:
        """Whether each of the model's layers is sparse."""
        if not self.experts:
            return (False,) * n_layers
        if self.layers is None:
            return (True,) * n_layers
        bad = [i for i in self.layers if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"{self.SECTION}.layers={list(self.layers)} names layer(s) "
                              f"{', '.join(map(str, bad))}, outside 0..{n_layers - 1}")
        return tuple(i in self.layers for i in range(n_layers))

    def to_dict(self):
        out = super().to_dict()
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


# ---- routing ------------------------------------------------------------------------


def route(logits, moe: MoEConfig, score_bias=None):
    """Router logits [N, E] -> (weights [N, k] float32, experts [N, k] int32, scores
    [N, E] float32); score_bias [E] shifts the choice only, never the weights."""
    row = moe.row
    scores = row.scores(logits.astype(jnp.float32))
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if moe.groups > 1:
        choice = limit_groups(choice, moe.groups, moe.topk_groups, row.group_score)
    _, experts = jax.lax.top_k(choice, moe.top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk if row.normalise is None else row.normalise:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), row.norm_min)
    return weights * moe.routed_scale, experts.astype(jnp.int32), scores


def limit_groups(choice, groups: int, keep: int, group_score):
    """choice [N, E] with every expert outside each token's `keep` best groups at -inf."""
    n, e = choice.shape
    grouped = choice.reshape(n, groups, e // groups)  # [N, G, E / G]
    _, best = jax.lax.top_k(group_score(grouped), keep)  # [N, keep]
    chosen = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], best].set(True)
    return jnp.where(chosen[:, :, None], grouped, -jnp.inf).reshape(n, e)


def dense_weights(weights, experts, n_experts: int):
    """The routing as [N, E]: each token's weight on every expert, 0 where not chosen."""
    return jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=weights.dtype)
                   * weights[..., None], axis=-2)


# ---- the experts' feed-forward network --------------------------------------------------


def expert_mlp(x, w, ffn, matmul, rows=None, precision: str = "default", args=()):
    """The experts' FFN on rows x [M, D]: matmul(x, kernel [E, in, out], *args) multiplies
    each row by its own expert's kernel (args: the arrays it reads beside them, passed
    explicitly, e.g. the group sizes); rows [M] (each row's expert) picks the biases
    ({name}_bias [E, out]) where the experts have them. w: wi_gate, wi_up, wo (gated) or
    wi, wo.

    A kernel may be a jaxformer.core.matmul.Int8Kernel (int8 values [E, in, out], a scale per
    expert and output channel [E, 1, out]: jaxformer.model.quantize): matmul reads the values,
    converted to the compute dtype in the product, and each row's output is times its
    expert's scale. precision: model.matmul_precision (MATMUL_PRECISIONS' grouped recipe)."""
    def per_expert(t):  # t [E, out] as each row's (rows None: broadcast over the rows)
        return t if rows is None else t[rows]

    def project(h, name):
        kernel, scale = w[name], None
        if isinstance(kernel, Int8Kernel):
            kernel, scale = kernel.values, kernel.scale[:, 0]  # [E, in, out], [E, out]
        if kernel.dtype.itemsize < h.dtype.itemsize:  # widened in the product: tied to the
            # input, so that XLA cannot hoist it out of a decode loop (matmul._int8_dot)
            kernel, h = jax.lax.optimization_barrier((kernel, h))
        y = MATMUL_PRECISIONS[precision].grouped(matmul, h, kernel, rows, *args)  # int8: as is
        if scale is not None:
            y = y * per_expert(scale).astype(y.dtype)
        bias = w.get(name + "_bias")
        return y if bias is None else y + per_expert(bias)

    if ffn.gated:
        h = ffn.join(project(x, "wi_gate"), project(x, "wi_up"))
    else:
        h = ffn.activation(project(x, "wi"))
    return project(h.astype(x.dtype), "wo")


GROUPED = over_rows(grouped_matmul)  # the dropless dispatch's grouped matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_rows(x, index, inverse, k: int):
    """x[index // k]: index a permutation of range(N k) (each of x's N rows taken k
    times), inverse its inverse permutation. Its gradient gathers by inverse and sums each
    row's k copies: autodiff's transpose of the gather would be a scatter-add, which
    XLA:CPU runs slowly."""
    return x[index // k]


def _take_rows_fwd(x, index, inverse, k):
    return x[index // k], inverse


def _take_rows_bwd(k, inverse, g):
    return jnp.sum(g[inverse].reshape(-1, k, *g.shape[1:]), axis=1), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def ragged_dispatch(x, weights, experts, w, ffn, *, capacity_factor=None, precision="default"):
    """Dropless: the N k assignments sorted by expert, each expert's rows one group of a
    grouped matmul, then back in token order and summed with their weights. The sort and
    un-sort are gathers both ways (take_rows), the group sizes read from the sorted
    experts: no scatter. x [N, D] -> (y [N, D], dropped fraction 0)."""
    n, k = experts.shape
    n_experts = jax.tree.leaves(w)[0].shape[0]
    flat = experts.reshape(-1)  # [N k], token-major
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    rows = flat[order]  # each sorted row's expert
    sizes = jnp.diff(jnp.searchsorted(rows, jnp.arange(n_experts + 1))).astype(jnp.int32)
    xs = take_rows(x, order, inverse, k)  # [N k, D]: each assignment's token, by expert

    # GROUPED(h, kernel, sizes): vmap batches it over the rows alone (moe.grouped_vmap)
    ys = expert_mlp(xs, w, ffn, GROUPED, rows, precision, (sizes,))  # [N k, D]
    ys = take_rows(ys, inverse, order, 1).reshape(n, k, -1)  # token order again
    y = jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))
    return y, jnp.float32(0)


def capacity_slots(experts, n_experts: int, capacity: int):
    """Each assignment's slot in its expert's buffer [N, k], and whether it got one:
    first choices before second ones, in token order within a choice."""
    onehot = jax.nn.one_hot(experts.T.reshape(-1), n_experts, dtype=jnp.int32)  # [k N, E]
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # [k N]
    slot = slot.reshape(experts.shape[1], -1).T  # [N, k]
    return slot, slot < capacity


def capacity_dispatch(x, weights, experts, w, ffn, *, capacity_factor, precision="default"):
    """A buffer of C = ceil(factor N k / E) rows per expert [E, C, D]; assignments past an
    expert's C are dropped. x [N, D] -> (y [N, D], the fraction of assignments dropped)."""
    n, k = experts.shape
    n_experts = jax.tree.leaves(w)[0].shape[0]
    capacity = max(1, math.ceil(capacity_factor * n * k / n_experts))
    slot, kept = capacity_slots(experts, n_experts, capacity)
    token = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    where = (experts, jnp.where(kept, slot, capacity))  # a dropped one writes out of range
    buffer = jnp.zeros((n_experts, capacity, x.shape[-1]), x.dtype).at[where].set(
        x[token], mode="drop")  # [E, C, D]

    def matmul(h, kernel):  # h [E, C, in]: each expert's rows by its kernel
        return jnp.einsum("eci,eio->eco", h, kernel.astype(h.dtype))

    rows = jnp.broadcast_to(jnp.arange(n_experts)[:, None], (n_experts, capacity))
    out = expert_mlp(buffer, w, ffn, matmul, rows, precision)  # [E, C, D]
    ys = out.at[where].get(mode="fill", fill_value=0)  # [N, k, D]
    y = jnp.einsum("nkd,nk->nd", ys, (weights * kept).astype(ys.dtype))
    return y, 1.0 - jnp.mean(kept.astype(jnp.float32))


def dense_dispatch(x, weights, experts, w, ffn, *, capacity_factor=None, precision="default"):
    """The reference: every expert on every token, summed with the routing's dense weights
    (0 where not chosen). x [N, D] -> (y [N, D], 0). E times the routed work."""
    n_experts = jax.tree.leaves(w)[0].shape[0]
    every = jnp.broadcast_to(x, (n_experts, *x.shape))  # [E, N, D]

    def matmul(h, kernel):
        return jnp.einsum("eni,eio->eno", h, kernel.astype(h.dtype))

    rows = jnp.broadcast_to(jnp.arange(n_experts)[:, None], every.shape[:2])
    out = expert_mlp(every, w, ffn, matmul, rows, precision)  # [E, N, D]
    dense = dense_weights(weights, experts, n_experts)  # [N, E]
    return jnp.einsum("end,ne->nd", out, dense.astype(out.dtype)), jnp.float32(0)


DISPATCHES = {"ragged": ragged_dispatch, "capacity": capacity_dispatch,
              "dense": dense_dispatch}


def dispatch_of(moe: MoEConfig) -> str:
    """The dispatch a config runs: its own, else capacity with a capacity_factor, else
    ragged (dropless)."""
    if moe.dispatch is not None:
        return moe.dispatch
    return "ragged" if moe.capacity_factor is None else "capacity"


# ---- balancing ----------------------------------------------------------------------


def expert_load(experts, n_experts: int, valid=None):
    """Assignments per expert [E] float32 (valid [N]: only those tokens counted)."""
    onehot = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32)  # [N, k, E]
    if valid is not None:
        onehot = onehot * valid[:, None, None]
    return jnp.sum(onehot, axis=(0, 1))


def balance_losses(logits, scores, load, valid=None):
    """(switch auxiliary loss, router z-loss), float32 scalars, over the valid tokens.

    aux = E * sum_e f_e p_e, f_e the share of assignments expert e got and p_e its mean
    routing probability (scores normalised per token): 1 when both are uniform (Fedus et
    al. 2021). z = mean over tokens of logsumexp(logits)^2 (Zoph et al. 2022)."""
    n_experts = scores.shape[-1]
    valid = jnp.ones(scores.shape[:1], jnp.float32) if valid is None else valid
    count = jnp.maximum(jnp.sum(valid), 1.0)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    p = jnp.sum(probs * valid[:, None], axis=0) / count  # [E]
    f = load / jnp.maximum(jnp.sum(load), 1.0)
    aux = n_experts * jnp.sum(f * p)
    z = jnp.sum(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2 * valid) / count
    return aux, z


def balanced_bias(bias, load, rate: float):
    """DeepSeek-V3's update of the selection bias: + rate for an expert under the mean
    load, - rate over it (unchanged at the mean)."""
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
