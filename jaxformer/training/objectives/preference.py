"""objective.name=dpo (Rafailov et al. 2023, "Direct Preference Optimization"): batches
of preference pairs (jaxformer.data.preferences: in each row, segment 2k - 1 is pair k's
chosen answer and segment 2k its rejected one, loss_mask on the answers' tokens). An answer's
log-probability log pi(y | x) is the sum of its tokens' log-softmax over its segment.
With the policy pi and the frozen reference pi_ref (the train.init_from weights),

    h = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)]
    sigmoid (DPO): -log sigmoid(beta h)        ipo (Azar et al. 2023): (h - 1 / (2 beta))^2

averaged over the pairs. The implicit rewards are beta (log pi - log pi_ref) of each
answer: reward_chosen, reward_rejected, their difference reward_margin, and
reward_accuracy (the share of pairs whose chosen reward is the higher).

The reference: with LoRA adapters it is the same params with every adapter's lora_scale
set to 0, i.e. the frozen base alone (no second copy of the weights); without, a copy of
the init_from weights that the loop passes to each step (it is never trained).

Settings (DPOSettings): beta, DPO's KL strength (IPO's tau), > 0; loss: sigmoid | ipo.
With model.loss_chunk=N the log-probs come through the head N positions at a time, policy
and reference alike (training.chunked_loss.target_logps): no [B, T, V] logits are held.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.core.validation import check_choice, check_number
from jaxformer.model import lora
from jaxformer.training.chunked_loss import target_logps
from jaxformer.training.objectives.entry import Objective, dense_only, fixed_name
from jaxformer.training.step import joined

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
LOSSES = {  # objective.loss -> each pair's loss of h (the module docstring) and beta
    "sigmoid": lambda h, beta: -jax.nn.log_sigmoid(beta * h),  # DPO
    "ipo": lambda h, beta: (h - 1.0 / (2.0 * beta)) ** 2,  # Azar et al.
}


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float,
             kind: str = "sigmoid", mask=None):
    """(the mean loss over the pairs, the mean of each of METRICS) from each pair's summed
    answer log-probabilities (arrays of one shape); mask: the pairs that count (default
    all). kind: sigmoid (DPO) | ipo."""
    losses, metrics = pair_terms(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                                 beta, kind)
    mask = jnp.ones_like(losses) if mask is None else mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    return jnp.sum(losses * mask) / n, {k: jnp.sum(v * mask) / n for k, v in metrics.items()}


def pair_terms(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, kind):
    """Each pair's loss and METRICS (unreduced)."""
    chosen = policy_chosen - ref_chosen        # log pi / pi_ref of the chosen answer
    rejected = policy_rejected - ref_rejected
    h = chosen - rejected
    if kind not in LOSSES:
        raise ValueError(f"objective.loss={kind!r} is not one of {', '.join(LOSSES)}")
    losses = LOSSES[kind](h, beta)
    metrics = {"reward_chosen": beta * chosen, "reward_rejected": beta * rejected,
               "reward_margin": beta * h, "reward_accuracy": (h > 0).astype(jnp.float32)}
    return losses, metrics


def pair_logps(model, params, batch, dropout_rng=None, chunk: int = 0) -> dict:
    """Each pair's answers, float32 [B, P] with P = T // 2 (pair k: segments 2k - 1 and
    2k): chosen and rejected, the summed answer log-probabilities (the targets'
    log-softmax where loss_mask is set, summed over the answer's segment);
    chosen_tokens and rejected_tokens, the answers' loss_mask counts; present, 1 where
    the row holds pair k. chunk: model.loss_chunk (the head `chunk` positions at a time:
    training.chunked_loss.target_logps)."""
    token, batch = target_logps(model, params, batch, chunk, dropout_rng)  # [B, T]
    seg, mask = batch["segment_ids"], batch["loss_mask"].astype(jnp.float32)
    n = seg.shape[1] + 1 + (seg.shape[1] % 2)  # segments 0 .. T (+1: an odd T's last pair)

    def per_row(x, s):  # [T], [T] -> [n]
        return jax.ops.segment_sum(x, s, num_segments=n)
    sums = jax.vmap(per_row)(token * mask, seg)  # [B, n]
    counts = jax.vmap(per_row)(mask, seg)
    tokens = jax.vmap(per_row)((seg > 0).astype(jnp.float32), seg)
    return {"chosen": sums[:, 1::2], "rejected": sums[:, 2::2],
            "chosen_tokens": counts[:, 1::2], "rejected_tokens": counts[:, 2::2],
            "present": (tokens[:, 1::2] > 0).astype(jnp.float32)}


def answer_logps(model, params, batch, dropout_rng=None, chunk: int = 0):
    """(chosen, rejected, present) of pair_logps."""
    p = pair_logps(model, params, batch, dropout_rng, chunk)
    return p["chosen"], p["rejected"], p["present"]


class Preference:
    """objective.name=dpo: the step's hooks (training/step.py) for DPO and IPO."""

    def __init__(self, cfg, chunk: int = 0):  # cfg: the objective's settings (DPOSettings)
        self.beta, self.kind = cfg.beta, cfg.loss
        self.chunk = chunk  # model.loss_chunk: the head a block of positions at a time

    def reference_logps(self, model, params, reference, batch):
        """The reference's (chosen, rejected) answer log-probabilities, outside the gradient:
        `reference` (the init_from weights) or, with LoRA, `params` without the adapters."""
        ref = lora.base_only(params) if reference is None else reference
        chosen, rejected, _ = answer_logps(model, jax.lax.stop_gradient(ref), batch,
                                           chunk=self.chunk)
        return jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)

    def terms(self, model, params, batch, ref, dropout_rng=None):
        """(summed loss over the pairs, the pair count, METRICS summed over the pairs)."""
        chosen, rejected, present = answer_logps(model, params, batch, dropout_rng, self.chunk)
        losses, metrics = pair_terms(chosen, rejected, *ref, self.beta, self.kind)
        return (jnp.sum(losses * present), jnp.sum(present),
                {k: jnp.sum(v * present) for k, v in metrics.items()})

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        """As step.gradient_sums: (summed loss, pair count, its gradient with respect to the
        trained part, METRICS' sums)."""
        dropout_rng = rng if model.cfg.dropout > 0 else None
        ref = self.reference_logps(model, joined(trained, frozen), reference, batch)

        def loss(t):
            total, count, sums = self.terms(model, joined(t, frozen), batch, ref, dropout_rng)
            return total, (count, sums)
        (total, (count, sums)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return total, count, grads, sums

    def eval_sums(self, model, params, batch, reference=None):
        """(summed loss, pair count, METRICS' sums) of a val batch."""
        return self.terms(model, params, batch,
                          self.reference_logps(model, params, reference, batch))

    @staticmethod
    def metrics(sums, count) -> dict:
        """A step's METRICS: the means over its pairs."""
        return {k: sums[k] / count for k in METRICS}


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """objective.name=dpo: beta, the KL strength (IPO's tau); loss, sigmoid (DPO) | ipo."""

    name: str = fixed_name("dpo")
    beta: float = 0.1
    loss: str = "sigmoid"

    def __post_init__(self):
        check_number("objective", "beta", self.beta, float, low=0, low_open=True)
        check_choice("objective", "loss", self.loss, LOSSES)


ENTRY = Objective(
    settings=DPOSettings,
    build=lambda cfg, tokenizer: Preference(cfg.objective, cfg.train.loss_chunk),
    batches={"decoder": ("pairs",)}, metrics=METRICS,
    perplexity=False,  # a loss per pair of answers; its evaluation logs val_reward_*
    reference=lambda settings: True, starts_from=True,
    check=dense_only, loss_chunk=True)
