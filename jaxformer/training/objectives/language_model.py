"""objective.name=lm: next-token cross entropy on the loss mask (pretraining on a corpus,
prompt/completion fine-tuning; training/step.py's loss, with MoE balancing and LoRA
sweeps), or, for model.arch=encoder_decoder, the target's cross entropy with
optim.label_smoothing (training/seq2seq.py). It takes no setting of its own.

With model.mtp_depth = D > 0 (multi-token prediction, jaxformer.model.mtp) the loss is
DeepSeek-V3's L = L_main + train.mtp_weight / D * sum_k L_k, L_k the mean cross entropy of
depth k's prediction of t_{i+k+1} at position i, over the positions whose target is in
the row, in the same packed segment and on the loss mask; `loss` stays L_main and each
L_k is logged as mtp_loss_k (val_mtp_loss_k at evaluation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.core.logprobs import target_logprobs
from jaxformer.core.validation import ConfigError
from jaxformer.model.archs import ARCHS, ENCODER_DECODER
from jaxformer.model.mtp import MAX_DEPTH, shifted, with_modules
from jaxformer.moe import balancing
from jaxformer.training import chunked_loss
from jaxformer.training.objectives.entry import Objective, fixed_name
from jaxformer.training.seq2seq import Seq2Seq
from jaxformer.training.step import LanguageModel, joined

MTP_METRICS = tuple(f"mtp_loss_{k}" for k in range(1, MAX_DEPTH + 1))


@dataclasses.dataclass(frozen=True)
class LMSettings:
    """objective.name=lm: no setting beside the name."""

    name: str = fixed_name("lm")


def mtp_masks(batch, depth: int):
    """[D, B, T] float32: depth k's position i counts where t_{i+k+1} (targets[i + k]) is in
    the row, on the loss mask, and in position i's segment (segment_ids, when packed)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    seg = batch.get("segment_ids")
    out = []
    for k in range(1, depth + 1):
        m = shifted(mask, k)  # 0 past the row's end
        if seg is not None:
            m = m * (shifted(seg, k, fill=-1) == seg)
        out.append(m)
    return jnp.stack(out)


def mtp_forward(model, params, batch, dropout_rng=None, hidden: bool = False):
    """The model with its MTP modules on the batch: ((logits [B, T, V], each depth's
    [D, B, T, V]), or with hidden the head's inputs (x [B, T, D], [D, B, T, D])), and the
    MoE layers' stats (the MTP modules' with experts after them: mtp.with_modules)."""
    cfg = model.cfg
    sparse = any(cfg.sparse_layers)
    deterministic = dropout_rng is None
    out = model.apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                      segment_ids=batch.get("segment_ids"), deterministic=deterministic,
                      rngs=None if deterministic else {"dropout": dropout_rng},
                      mutable=["moe"] if sparse else False, mtp=True, hidden=hidden)
    outputs, sown = out if sparse else (out, None)
    stats = with_modules(cfg, balancing.layer_stats(cfg, sown["moe"]), sown["moe"]) \
        if sparse else {}  # the sparse layers' rows, then the MTP modules'
    return outputs, stats


def mtp_terms(model, params, batch, dropout_rng=None):
    """(summed main cross entropy, its count, the MoE layers' stats (mtp_forward), each
    depth's summed cross entropy [D], each depth's count [D]) of one forward with the MTP
    modules."""
    (logits, more), stats = mtp_forward(model, params, batch, dropout_rng)
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = -target_logprobs(logits, batch["targets"])  # [B, T]
    depth = model.cfg.mtp_depth
    targets = jnp.stack([shifted(batch["targets"], k) for k in range(1, depth + 1)])
    masks = mtp_masks(batch, depth)  # [D, B, T]
    mtp_nll = -target_logprobs(more, targets)  # [D, B, T]
    return (jnp.sum(nll * mask), jnp.sum(mask), stats, jnp.sum(mtp_nll * masks, (1, 2)),
            jnp.sum(masks, (1, 2)))


def mtp_chunked_terms(model, params, batch, chunk: int, dropout_rng=None):
    """mtp_terms with the head and every loss `chunk` positions at a time (model.loss_chunk:
    training.chunked_loss): the main loss on the last block's output, depth k's on module
    k's normed output, so no [B, T, V] logits of any depth are held."""
    cfg = model.cfg
    (x, normed), stats = mtp_forward(model, params, batch, dropout_rng, hidden=True)
    total, count = chunked_loss.head_sums(cfg, params, x, batch["targets"],
                                          batch["loss_mask"], chunk)
    masks = mtp_masks(batch, cfg.mtp_depth)  # [D, B, T]
    each = [chunked_loss.head_sums(cfg, params, normed[k - 1], shifted(batch["targets"], k),
                                   masks[k - 1], chunk, final=False)
            for k in range(1, cfg.mtp_depth + 1)]
    return (total, count, stats, jnp.stack([s for s, _ in each]),
            jnp.stack([n for _, n in each]))


@dataclasses.dataclass(frozen=True)
class MultiTokenLM(LanguageModel):
    """The lm objective's hooks with the MTP loss (model.mtp_depth > 0): weight is
    train.mtp_weight. Sums: the MoE layers' (balancing.step_sums) and mtp_sum, mtp_count
    [D]."""

    weight: float = 0.3
    chunk: int = 0  # model.loss_chunk: the head and losses a block at a time (0: whole)

    def terms(self, model, params, batch, dropout_rng=None):
        """mtp_terms, or mtp_chunked_terms with a chunk."""
        if self.chunk:
            return mtp_chunked_terms(model, params, batch, self.chunk, dropout_rng)
        return mtp_terms(model, params, batch, dropout_rng)

    def train_loss(self, model, params, batch, dropout_rng=None):
        """(summed train loss: main cross entropy + count x (MoE penalty + weight x the mean
        over depths of L_k), (main summed cross entropy, count, sums))."""
        total, count, stats, sums, counts = self.terms(model, params, batch, dropout_rng)
        mean = jnp.mean(sums / jnp.maximum(counts, 1.0))  # 1/D sum_k L_k
        train = total + count * (balancing.penalty(model.cfg.moe, stats) + self.weight * mean)
        return train, (total, count, {**balancing.step_sums(stats, count), "mtp_sum": sums,
                                      "mtp_count": counts})

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        dropout_rng = rng if model.cfg.dropout > 0 else None
        (_, (total, count, sums)), grads = jax.value_and_grad(
            lambda t: self.train_loss(model, joined(t, frozen), batch, dropout_rng),
            has_aux=True)(trained)
        return total, count, grads, sums

    def eval_sums(self, model, params, batch, reference=None):
        """(summed main cross entropy, count, {mtp_loss_k: L_k x count}): the loop's
        val_mtp_loss_k is then each depth's mean (over batches, weighted by count)."""
        total, count, _, sums, counts = self.terms(model, params, batch)
        each = sums / jnp.maximum(counts, 1.0) * count
        return total, count, {n: each[k] for k, n in enumerate(MTP_METRICS[:len(each)])}

    def metrics(self, sums, count) -> dict:
        """The MoE layers' metrics and mtp_loss_k: depth k's mean cross entropy."""
        moe = {k: v for k, v in sums.items() if not k.startswith("mtp_")}
        each = sums["mtp_sum"] / jnp.maximum(sums["mtp_count"], 1.0)
        return {**super().metrics(moe, count),
                **{n: each[k] for k, n in enumerate(MTP_METRICS[:each.shape[0]])}}


def build(cfg, tokenizer=None):
    """The step hooks: the encoder-decoder's (Seq2Seq) or the decoder's (LanguageModel;
    MultiTokenLM with model.mtp_depth > 0, chunked too with model.loss_chunk;
    ChunkedLanguageModel with model.loss_chunk)."""
    if ARCHS[cfg.model.arch].encoder:  # an encoder stack of its own: source/target pairs
        return Seq2Seq(cfg.optim.label_smoothing, cfg.train.loss_chunk)
    if cfg.model.mtp_depth:
        return MultiTokenLM(cfg.optim.grad_accum, cfg.train.mtp_weight, cfg.train.loss_chunk)
    if cfg.train.loss_chunk:  # model.loss_chunk: the head and loss a block at a time
        return chunked_loss.ChunkedLanguageModel(cfg.optim.grad_accum, cfg.train.loss_chunk)
    return LanguageModel(cfg.optim.grad_accum)


def check(cfg) -> None:
    """MTP trains one model (no LoRA sweep) on whole rows (no context split): one line."""
    if cfg.model.mtp_depth and (len(cfg.model.lora.members()) > 1 or cfg.mesh.context > 1):
        raise ConfigError(f"model.mtp_depth={cfg.model.mtp_depth} trains one model on whole "
                          "rows; drop model.lora.sweep_* and use mesh.context=1")


ENTRY = Objective(settings=LMSettings, build=build,
                  batches={"decoder": ("tokens", "completions"),
                           ENCODER_DECODER: ("sources",)},
                  metrics=MTP_METRICS, check=check, loss_chunk=True)
