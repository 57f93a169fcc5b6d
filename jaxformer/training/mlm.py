"""objective.name=mlm: the masked language model of BERT (Devlin et al. 2019), for
model.arch=encoder.

Each step chooses objective.mask_rate of a row's tokens (each token alone, with that
probability, as Hugging Face's DataCollatorForLanguageModeling does), never padding nor the
tokenizer's end-of-text id (the document separator: BERT never masks its special tokens,
and the collator skips them too); of the chosen,
80% become the mask id, 10% a random token (uniform over the vocabulary without the mask
id) and 10% stay as they are. The loss is the cross entropy of the original token at the
chosen positions only, their mean. The corruption is drawn inside the jitted step from the
step's key (the train state's rng folded with the step, and with the micro-batch), so a
resumed run draws the same masks; a val batch's is drawn from a fixed key folded with its
tokens' sum, the same at every evaluation.

With model.loss_chunk=N the head and the cross entropy run N positions at a time
(training/chunked_loss.py: the chosen positions' labels and weights as its targets and loss
mask), so no step holds the [B, T, V] logits.

The mask id: objective.mask_id where set (a tokenizer's own [MASK]), else the last id of
the vocabulary, model.vocab_size - 1, reserved for it (with the byte tokenizer: 255, a
byte that UTF-8 text never holds).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.core.logprobs import target_logprobs
from jaxformer.training.chunked_loss import chunked_terms
from jaxformer.training.step import joined, logits_of

# of the chosen tokens: the share masked, and (cumulated) that masked or made random
TO_MASK, TO_MASK_OR_RANDOM = 0.8, 0.9
_EVAL_KEY = 0x6D6C6D  # the val batches' corruption: this key folded with their tokens' sum


def mask_id_of(objective_cfg, model_cfg) -> int:
    """The id that replaces a masked token: objective.mask_id, else vocab_size - 1."""
    return model_cfg.vocab_size - 1 if objective_cfg.mask_id is None else objective_cfg.mask_id


def eligible_positions(tokens, segment_ids, eot_id: int | None):
    """bool [B, T]: the positions of tokens int32 [B, T] that may be chosen: not padding
    (segment id 0) and not the end-of-text id (None: the tokenizer has none)."""
    eligible = jnp.ones(tokens.shape, bool) if segment_ids is None else segment_ids > 0
    return eligible if eot_id is None else eligible & (tokens != eot_id)


def corrupt(key, tokens, eligible, *, rate: float, mask_id: int, vocab_size: int):
    """BERT's corruption of tokens int32 [B, T]: (the corrupted tokens, the chosen
    positions bool [B, T]). eligible bool [B, T]: the positions that may be chosen (not
    padding)."""
    pick, kind, draw = jax.random.split(key, 3)
    chosen = eligible & (jax.random.uniform(pick, tokens.shape) < rate)
    u = jax.random.uniform(kind, tokens.shape)
    other = jax.random.randint(draw, tokens.shape, 0, vocab_size - 1, dtype=tokens.dtype)
    other = other + (other >= mask_id).astype(tokens.dtype)  # any id but the mask's
    out = jnp.where(chosen & (u < TO_MASK), jnp.asarray(mask_id, tokens.dtype),
                    jnp.where(chosen & (u < TO_MASK_OR_RANDOM), other, tokens))
    return out, chosen


@dataclasses.dataclass(frozen=True)
class MaskedLM:
    """objective.name=mlm: the step's hooks (training/step.py), as objectives.Preference;
    hashable by value (a cached step builder may key on it)."""

    rate: float
    mask_id: int
    vocab_size: int
    eot_id: int | None = None  # the tokenizer's end-of-text, never chosen
    chunk: int = 0  # model.loss_chunk: positions per block of the head and loss (0: all)

    @classmethod
    def of(cls, cfg, tokenizer=None) -> "MaskedLM":
        """The objective of a RunConfig (its objective, model and train sections) and the
        data's tokenizer (its eot_id; None: no end-of-text to skip)."""
        return cls(cfg.objective.mask_rate, mask_id_of(cfg.objective, cfg.model),
                   cfg.model.vocab_size, getattr(tokenizer, "eot_id", None),
                   cfg.train.loss_chunk)

    def terms(self, model, params, batch, key, dropout_rng=None):
        """(summed cross entropy at the chosen positions, their count, {})."""
        tokens = batch["inputs"]
        eligible = eligible_positions(tokens, batch.get("segment_ids"), self.eot_id)
        inputs, chosen = corrupt(key, tokens, eligible, rate=self.rate, mask_id=self.mask_id,
                                 vocab_size=self.vocab_size)
        # labels and weights ride in the batch: logits_of may reorder its rows' positions
        batch = {**batch, "inputs": inputs, "mlm_labels": tokens,
                 "mlm_weights": chosen.astype(jnp.float32)}
        if self.chunk:  # the chosen tokens' cross entropy, the head a block at a time
            blocks = {**batch, "targets": tokens, "loss_mask": batch["mlm_weights"]}
            return (*chunked_terms(model, params, blocks, self.chunk,
                                   dropout_rng=dropout_rng)[:2], {})
        logits, batch = logits_of(model, params, batch, dropout_rng)  # [B, T, V] float32
        nll = -target_logprobs(logits, batch["mlm_labels"])  # [B, T]
        return jnp.sum(nll * batch["mlm_weights"]), jnp.sum(batch["mlm_weights"]), {}

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        """As step.gradient_sums: (summed loss, chosen count, its gradient, {})."""
        key, dropout_rng = jax.random.split(rng)
        dropout_rng = dropout_rng if model.cfg.dropout > 0 else None

        def loss(t):
            total, count, _ = self.terms(model, joined(t, frozen), batch, key, dropout_rng)
            return total, count
        (total, count), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return total, count, grads, {}

    def eval_sums(self, model, params, batch, reference=None):
        """(summed loss, chosen count, {}) of a val batch, its corruption fixed."""
        seed = jnp.sum(batch["inputs"].astype(jnp.uint32))
        key = jax.random.fold_in(jax.random.PRNGKey(_EVAL_KEY), seed)
        return self.terms(model, params, batch, key)

    @staticmethod
    def metrics(sums, count) -> dict:
        return {}
