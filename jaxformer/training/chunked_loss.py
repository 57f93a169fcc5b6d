"""model.loss_chunk=N: the LM head and the cross entropy over blocks of N positions of every
row, forward and backward, so no step holds the [B, T, V] logits (0: the plain loss).
An objective takes it where its entry says so (Objective.loss_chunk): lm's hooks here (and
its multi-token prediction's: each depth's loss through the same head, a block at a time,
training/objectives/language_model.py; the encoder-decoder's target loss through its
decoder's head, training/seq2seq.py), mlm's chosen tokens (training/mlm.py), and the
post-training objectives' token log-probs (target_logps: dpo's and orpo's answers, policy
and reference; token_logps: grpo's); an entry without it refuses it at config time.

The model gives its last block's output x [B, T, D] (Transformer(..., hidden=True); the full
logits it also returns are dead code under jit and compiled away); a lax.scan then runs,
block by block, the model's own head (Head: the final norm, the LM head tied or not, its
bias, multiplier and soft-cap: Transformer.logits itself) and the loss on [B, N] tokens, the
block under jax.checkpoint, so the backward recomputes each block's logits [B, N, V] instead
of keeping them: peak memory holds one block's logits and their gradient, B N V float32
each, not B T V. The price is the head's forward matmul once more (2 B T D V FLOPs).

Blocks run over positions, not over the vocabulary (MaxText's vocab tiling and torchtitan's
chunked loss split tokens too; levanter's fused loss blocks both): every op of the head is
per token, so a token block is the model's head unchanged (the final norm, soft-cap, a BERT
head transform), each block's log-sum-exp is exact in one pass, and the batch axis (the
data-parallel split) stays whole. A vocabulary split would need an online log-sum-exp, the
head's weight cut by rows, and would recompute the final norm per block.

token_losses is the loss of one block: the cross entropy, with optional label smoothing e
(targets (1 - e) one-hot + e / V, optax's convention) and z-loss z (z * logsumexp^2, PaLM's).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention.ring import zigzag_batch
from jaxformer.core.logprobs import aligned, target_logprobs, token_logprobs
from jaxformer.core.sharding import sequence_split
from jaxformer.model.archs import ARCHS
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import Transformer
from jaxformer.moe import balancing
from jaxformer.training.step import LanguageModel, logits_of

HEAD_PARAMS = ("embed", "final_norm", "head_transform", "head_norm", "lm_head", "head_bias")


class Head(nn.Module):
    """The Transformer's head on its own: x [B, N, D] (the last block's output; with final
    false, already normed: an MTP module's) -> float32 logits [B, N, V], read from the
    Transformer's params of the same names (HEAD_PARAMS)."""

    cfg: ModelConfig
    final: bool = True  # the final norm first

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
                         name="embed")  # the tied head's table (its params, as the model's)
        return Transformer.logits(self, embed, x, final=self.final)


def token_losses(logits, targets, label_smoothing: float = 0.0, z_loss: float = 0.0):
    """Per-token loss: logits [..., V] float32, targets int [...] -> float32 [...]: the cross
    entropy against (1 - e) one-hot + e / V, plus z_loss * logsumexp(logits)^2."""
    lse = jax.nn.logsumexp(logits, axis=-1)  # [...]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - jnp.mean(logits, -1))
    if z_loss:
        loss = loss + z_loss * jnp.square(lse)
    return loss


def blockwise(head, head_params, x, targets, chunk: int, per_token):
    """per_token(logits [B, N, V], targets [B, N]) -> [B, N] (or a tuple of them) of every
    block of `chunk` positions, logits = head(head_params, x block), each block under
    jax.checkpoint (the backward recomputes its logits): float32 [B, T] (or a tuple) for
    x [B, T, D], targets [B, T]. T is padded to a multiple of chunk, and the padding's
    values dropped."""
    b, t = targets.shape
    n = -(-t // chunk)
    pad = [(0, 0), (0, n * chunk - t)]
    x, targets = jnp.pad(x, pad + [(0, 0)] * (x.ndim - 2)), jnp.pad(targets, pad)

    def blocks(a):  # [B, n * N, ...] -> [n, B, N, ...]
        return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def block(hp, xb, tb):
        return per_token(head(hp, xb), tb)  # [B, N] from [B, N, V] float32 logits

    values = jax.lax.scan(lambda _, xs: (None, block(head_params, *xs)), None,
                          (blocks(x), blocks(targets)))[1]  # [n, B, N] each
    return jax.tree.map(lambda v: jnp.moveaxis(v, 0, 1).reshape(b, n * chunk)[:, :t], values)


def chunked_sums(head, head_params, x, targets, mask, chunk: int, *,
                 label_smoothing: float = 0.0, z_loss: float = 0.0):
    """(sum of token_losses x mask, sum of mask) with logits = head(head_params, x block),
    `chunk` positions of every row at a time (blockwise): x [B, T, D], targets and mask
    [B, T]."""
    losses = blockwise(head, head_params, x, targets, chunk,
                       lambda logits, tb: token_losses(logits, tb, label_smoothing, z_loss))
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def model_head(cfg: ModelConfig, params, final: bool = True):
    """(head(head_params, x) -> logits, head_params): the model's own head (Head; final: see
    there) and its params out of the model's: an encoder-decoder's are its decoder
    stack's, the token table (embed) the model's."""
    head = Head(cfg, final)
    scope = params["decoder"] if ARCHS[cfg.arch].cross_attention else params
    return (lambda hp, h: head.apply({"params": hp}, h),
            {"embed": params["embed"], **{k: scope[k] for k in HEAD_PARAMS if k in scope}})


def head_sums(cfg: ModelConfig, params, x, targets, mask, chunk: int, final: bool = True):
    """chunked_sums through the model's own head (model_head): (sum of the cross entropy x
    mask, sum of mask)."""
    return chunked_sums(*model_head(cfg, params, final), x, targets, mask, chunk)


def target_logps(model, params, batch, chunk: int = 0, dropout_rng=None):
    """(the log-probs of batch's targets [B, T] (core.logprobs.target_logprobs), the batch
    they are of: training.step.logits_of's): from the whole logits with chunk 0, else
    through the model's head `chunk` positions at a time (blockwise)."""
    if not chunk:
        logits, batch = logits_of(model, params, batch, dropout_rng)  # [B, T, V] float32
        return target_logprobs(logits, batch["targets"]), batch
    x, batch, _ = hidden_of(model, params, batch, dropout_rng)
    return blockwise(*model_head(model.cfg, params), x, batch["targets"], chunk,
                     target_logprobs), batch


def token_logps(model, params, tokens, positions=None, segment_ids=None, chunk: int = 0):
    """core.logprobs.token_logprobs (teacher-forced log-probs of tokens [B, T], aligned with
    them), with chunk > 0 through the model's head `chunk` positions at a time."""
    if not chunk:
        return token_logprobs(model, params, tokens, positions, segment_ids)
    _, x = model.apply({"params": params}, tokens, positions=positions,
                       segment_ids=segment_ids, hidden=True)  # the logits go unused
    return aligned(blockwise(*model_head(model.cfg, params), x[:, :-1], tokens[:, 1:], chunk,
                             target_logprobs), segment_ids)


def hidden_of(model, params, batch, dropout_rng=None, sown: bool = False):
    """As training.step.logits_of, the last block's output x [B, T, D] in place of the
    logits: (x, the batch it is of (zigzag order under context parallelism), the "moe"
    collection or None)."""
    deterministic = dropout_rng is None
    split = sequence_split()
    if split is not None:
        batch = zigzag_batch(batch, split[0].shape[split[1]])
    out = model.apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                      segment_ids=batch.get("segment_ids"), deterministic=deterministic,
                      rngs=None if deterministic else {"dropout": dropout_rng},
                      mutable=["moe"] if sown else False, hidden=True)
    (_, x), collections = out if sown else (out, None)  # the full logits go unused
    return x, batch, collections


def chunked_terms(model, params, batch, chunk: int, *, dropout_rng=None):
    """As training.step.loss_terms (summed cross entropy on the loss mask, its count, the
    sparse layers' statistics), the head and the loss run `chunk` positions at a time."""
    sparse = any(model.cfg.sparse_layers)
    x, batch, sown = hidden_of(model, params, batch, dropout_rng, sparse)
    total, count = head_sums(model.cfg, params, x, batch["targets"], batch["loss_mask"], chunk)
    stats = balancing.layer_stats(model.cfg, sown["moe"]) if sparse else {}
    return total, count, stats


@dataclasses.dataclass(frozen=True)
class ChunkedLanguageModel(LanguageModel):
    """The lm objective's hooks (training.step.LanguageModel: MoE balancing, LoRA sweeps)
    with the chunked loss: chunk = model.loss_chunk positions per block."""

    chunk: int = 0

    def token_terms(self, model, params, batch, *, dropout_rng=None):
        return chunked_terms(model, params, batch, self.chunk, dropout_rng=dropout_rng)

