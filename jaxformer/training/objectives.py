"""Training objectives beside the language model's (objective.name; step.py holds lm's,
training/mlm.py the masked language model's).

dpo (Rafailov et al. 2023, "Direct Preference Optimization"): batches of preference
pairs (jaxformer.data.preferences: in each row, segment 2k - 1 is pair k's chosen answer
and segment 2k its rejected one, loss_mask on the answers' tokens). An answer's
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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.logprobs import target_logprobs
from jaxformer.model import lora
from jaxformer.model.archs import ENCODER_DECODER
from jaxformer.training.grpo_step import GroupPolicy
from jaxformer.training.mlm import MaskedLM
from jaxformer.training.seq2seq import Seq2Seq
from jaxformer.training.step import joined, logits_of

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
GRPO_METRICS = ("reward_mean", "reward_std", "completion_len", "ratio_first", "ratio_mean",
                "clip_fraction", "kl", "rollout_s", "reward_s", "update_s",
                "rollout_tokens_per_s", "update_tokens_per_s")  # grpo_step's, per step


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
    if kind == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * h)
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"objective.loss={kind!r} is not one of sigmoid, ipo")
    metrics = {"reward_chosen": beta * chosen, "reward_rejected": beta * rejected,
               "reward_margin": beta * h, "reward_accuracy": (h > 0).astype(jnp.float32)}
    return losses, metrics


def answer_logps(model, params, batch, dropout_rng=None):
    """(chosen, rejected, present), each float32 [B, P] with P = T // 2: each pair's summed
    answer log-probabilities (the targets' log-softmax where loss_mask is set, summed
    over the answer's segment), and 1 where the row holds pair k."""
    logits, batch = logits_of(model, params, batch, dropout_rng)  # [B, T, V] float32
    token = target_logprobs(logits, batch["targets"])  # [B, T]: the LM loss's log-softmax
    seg = batch["segment_ids"]
    n = seg.shape[1] + 1 + (seg.shape[1] % 2)  # segments 0 .. T (+1: an odd T's last pair)

    def per_row(x, s):  # [T], [T] -> [n]
        return jax.ops.segment_sum(x, s, num_segments=n)
    sums = jax.vmap(per_row)(token * batch["loss_mask"].astype(jnp.float32), seg)  # [B, n]
    tokens = jax.vmap(per_row)((seg > 0).astype(jnp.float32), seg)
    return sums[:, 1::2], sums[:, 2::2], (tokens[:, 1::2] > 0).astype(jnp.float32)


class Preference:
    """objective.name=dpo: the step's hooks (training/step.py) for DPO and IPO."""

    def __init__(self, cfg):  # cfg: the ObjectiveConfig
        self.beta, self.kind = cfg.beta, cfg.loss

    def reference_logps(self, model, params, reference, batch):
        """The reference's (chosen, rejected) answer log-probabilities, outside the gradient:
        `reference` (the init_from weights) or, with LoRA, `params` without the adapters."""
        ref = lora.base_only(params) if reference is None else reference
        chosen, rejected, _ = answer_logps(model, jax.lax.stop_gradient(ref), batch)
        return jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)

    def terms(self, model, params, batch, ref, dropout_rng=None):
        """(summed loss over the pairs, the pair count, METRICS summed over the pairs)."""
        chosen, rejected, present = answer_logps(model, params, batch, dropout_rng)
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
class Objective:
    """One objective.name: build(cfg, tokenizer), its step hooks from the RunConfig and
    the data's tokenizer (None: step.py's LM loss), and perplexity, whether its validation
    loss is a mean per-token cross entropy whose exp is a perplexity (the run logs
    val_ppl); DPO's is a loss per pair of answers, and its validation logs that loss and
    the pairs' rewards (val_reward_*)."""
    build: Callable
    perplexity: bool


OBJECTIVES = {  # objective.name -> its entry; grpo's checks its reward now, before the data
    "lm": Objective(lambda cfg, tokenizer: None, perplexity=True),
    "mlm": Objective(MaskedLM.of, perplexity=True),  # the masked tokens' cross entropy
    "dpo": Objective(lambda cfg, tokenizer: Preference(cfg.objective), perplexity=False),
    "grpo": Objective(lambda cfg, tokenizer: GroupPolicy(cfg),
                      perplexity=True),  # the val answers' cross entropy
}


def build(cfg, tokenizer=None):
    """The objective for cfg.objective (a RunConfig's): its OBJECTIVES entry's; an
    encoder-decoder's (model.arch=encoder_decoder, objective.name=lm) is
    training/seq2seq.py's. tokenizer: the data's (mlm never masks its eot_id); None
    before the data loads."""
    if cfg.model.arch == ENCODER_DECODER:
        return Seq2Seq(cfg.optim.label_smoothing)
    return OBJECTIVES[cfg.objective.name].build(cfg, tokenizer)


def has_perplexity(cfg) -> bool:
    """Whether the run's validation loss has a perplexity (Objective.perplexity)."""
    return OBJECTIVES[cfg.objective.name].perplexity


def needs_reference(cfg) -> bool:
    """Whether the steps take the init_from weights as their frozen reference: DPO, and
    GRPO with objective.beta > 0, without LoRA (with LoRA the base in the params is the
    reference)."""
    o = cfg.objective
    return (o.name == "dpo" or (o.name == "grpo" and o.beta > 0)) and not cfg.model.lora.rank


def reference_weights(cfg, initial):
    """The frozen reference the steps take (needs_reference), or None: a copy of the
    init_from weights `initial` in their own buffers (the train step donates the state's)."""
    if not needs_reference(cfg):
        return None
    return jax.tree.map(lambda x: jnp.array(x, copy=True), initial)


def step_records(metrics) -> dict:
    """A step's objective metrics (fetched to the host) as metrics.jsonl keys."""
    return {k: float(np.mean(metrics[k])) for k in METRICS + GRPO_METRICS if k in metrics}
