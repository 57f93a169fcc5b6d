"""objective.name=orpo (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
Reference Model") on data.format=preference pairs (read as DPO reads them:
preference.pair_logps). No reference model and no SFT stage before it: the chosen
answer's language-model loss and an odds-ratio term in one loss,

    l(y)  = (1 / |y|) sum_t log p(y_t | x, y_<t)     the answer's mean token log-prob
    odds  = p / (1 - p) with p = exp(l(y)),  log odds(y) = l(y) - log(1 - exp(l(y)))
    L     = -l(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l))

averaged over the pairs (TRL's ORPOTrainer averages its SFT term over all the chosen
tokens of the batch instead). l(y) is capped at -1e-6 so that log(1 - exp(l)) stays
finite. Settings: beta, lambda (TRL's name for it), >= 0 (0: SFT on the chosen answers).
Logged: nll_chosen (-l(y_w)), log_odds_ratio, odds_ratio_loss (the term lambda
weighs) and odds_accuracy (the share of pairs whose chosen answer has the higher odds).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.core.validation import check_number
from jaxformer.training.objectives.entry import Objective, dense_only, fixed_name
from jaxformer.training.objectives.preference import pair_logps
from jaxformer.training.step import joined

METRICS = ("nll_chosen", "log_odds_ratio", "odds_ratio_loss", "odds_accuracy")
MAX_LOG_P = -1e-6  # l(y) <= this: 1 - exp(l) > 0


def log_odds(log_p):
    """log p / (1 - p) from log p < 0, as log p - log(1 - exp(log p)) (expm1: exact near 0)."""
    return log_p - jnp.log(-jnp.expm1(log_p))


def odds_ratio_terms(chosen, rejected, chosen_tokens, rejected_tokens, lam):
    """Each pair's loss and METRICS (unreduced) from the answers' summed token
    log-probabilities and their token counts (arrays of one shape)."""
    mean_w = jnp.minimum(chosen / jnp.maximum(chosen_tokens, 1.0), MAX_LOG_P)
    mean_l = jnp.minimum(rejected / jnp.maximum(rejected_tokens, 1.0), MAX_LOG_P)
    ratio = log_odds(mean_w) - log_odds(mean_l)
    term = -jax.nn.log_sigmoid(ratio)
    metrics = {"nll_chosen": -mean_w, "log_odds_ratio": ratio, "odds_ratio_loss": term,
               "odds_accuracy": (ratio > 0).astype(jnp.float32)}
    return -mean_w + lam * term, metrics


class OddsRatio:
    """objective.name=orpo: the step's hooks (training/objectives/entry.py)."""

    def __init__(self, settings, chunk: int = 0):
        self.lam = settings.beta
        self.chunk = chunk  # model.loss_chunk: the head a block of positions at a time

    def terms(self, model, params, batch, dropout_rng=None):
        """(summed loss over the pairs, the pair count, METRICS summed over the pairs)."""
        p = pair_logps(model, params, batch, dropout_rng, self.chunk)
        losses, metrics = odds_ratio_terms(p["chosen"], p["rejected"], p["chosen_tokens"],
                                           p["rejected_tokens"], self.lam)
        present = p["present"]
        return (jnp.sum(losses * present), jnp.sum(present),
                {k: jnp.sum(v * present) for k, v in metrics.items()})

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        dropout_rng = rng if model.cfg.dropout > 0 else None

        def loss(t):
            total, count, sums = self.terms(model, joined(t, frozen), batch, dropout_rng)
            return total, (count, sums)
        (total, (count, sums)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return total, count, grads, sums

    def eval_sums(self, model, params, batch, reference=None):
        return self.terms(model, params, batch)

    @staticmethod
    def metrics(sums, count) -> dict:
        return {k: sums[k] / count for k in METRICS}


@dataclasses.dataclass(frozen=True)
class ORPOSettings:
    """objective.name=orpo: beta, the odds-ratio term's weight lambda, >= 0."""

    name: str = fixed_name("orpo")
    beta: float = 0.1

    def __post_init__(self):
        check_number("objective", "beta", self.beta, float, low=0)


ENTRY = Objective(
    settings=ORPOSettings,
    build=lambda cfg, tokenizer: OddsRatio(cfg.objective, cfg.train.loss_chunk),
    batches={"decoder": ("pairs",)}, metrics=METRICS,
    perplexity=False,  # a loss per pair; its evaluation logs val_odds_accuracy and the rest
    check=dense_only, loss_chunk=True)
