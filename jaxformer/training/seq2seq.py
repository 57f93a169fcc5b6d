"""The encoder-decoder's training objective (model.arch=encoder_decoder on
data.format=seq2seq batches: jaxformer.data.seq2seq): the target's cross entropy, with
label smoothing (optim.label_smoothing e: the target distribution (1 - e) one-hot + e /
vocab, optax.smooth_labels' convention; Vaswani et al. used e = 0.1).

The gradient is the smoothed loss's; the loss logged (train and val) is the plain cross
entropy, comparable across smoothing settings and with perplexity. With model.loss_chunk=N
both come from the decoder's head N target positions at a time (training/chunked_loss.py),
so no step holds the target's [B, T, V] logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.logprobs import target_logprobs
from jaxformer.data.seq2seq import end_id
from jaxformer.decode.seq2seq import seq2seq_generate
from jaxformer.training.chunked_loss import blockwise, model_head
from jaxformer.training.step import joined


def smoothed_cross_entropy(logits, targets, smoothing: float):
    """Per-token -sum_v q_v log p_v with q = (1 - smoothing) one-hot(targets) +
    smoothing / V: logits [..., V] float32, targets [...] -> [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return (1.0 - smoothing) * nll - smoothing * jnp.mean(logp, axis=-1)


def seq2seq_logits(model, params, batch, dropout_rng=None, hidden: bool = False):
    """The target's logits [B, T, V] float32 for a seq2seq batch (source and target packed);
    with hidden (logits, the head's input x [B, T, D]): EncoderDecoder's hidden."""
    deterministic = dropout_rng is None
    return model.apply({"params": params}, batch["sources"], batch["inputs"],
                       source_segment_ids=batch["source_segment_ids"],
                       target_segment_ids=batch["segment_ids"],
                       source_positions=batch["source_positions"],
                       target_positions=batch["positions"], deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": dropout_rng}, hidden=hidden)


class Seq2Seq:
    """The step's hooks (training/step.py's objective interface) for an encoder-decoder.
    chunk: model.loss_chunk (the decoder's head and the losses `chunk` target positions at
    a time; 0: from the whole logits)."""

    def __init__(self, smoothing: float, chunk: int = 0):
        self.smoothing, self.chunk = smoothing, chunk

    def token_losses(self, logits, targets):
        """(smoothed loss, cross entropy) per token of logits [..., V]: [...] each."""
        return (smoothed_cross_entropy(logits, targets, self.smoothing),
                -target_logprobs(logits, targets))

    def sums(self, model, params, batch, dropout_rng=None):
        """(summed smoothed loss, summed cross entropy, target token count)."""
        targets, mask = batch["targets"], batch["loss_mask"].astype(jnp.float32)
        if self.chunk:  # the decoder's head and both losses a block of positions at a time
            _, x = seq2seq_logits(model, params, batch, dropout_rng, hidden=True)
            smoothed, nll = blockwise(*model_head(model.cfg, params), x, targets, self.chunk,
                                      self.token_losses)
        else:
            smoothed, nll = self.token_losses(seq2seq_logits(model, params, batch, dropout_rng),
                                              targets)
        return jnp.sum(smoothed * mask), jnp.sum(nll * mask), jnp.sum(mask)

    def gradient_sums(self, model, trained, frozen, batch, rng, reference=None):
        """(summed cross entropy, token count, the smoothed loss's gradient, {})."""
        dropout_rng = rng if model.cfg.dropout > 0 else None

        def loss(t):
            smoothed, nll, count = self.sums(model, joined(t, frozen), batch, dropout_rng)
            return smoothed, (nll, count)
        (_, (nll, count)), grads = jax.value_and_grad(loss, has_aux=True)(trained)
        return nll, count, grads, {}

    def eval_sums(self, model, params, batch, reference=None):
        """(summed cross entropy, token count, {}) of a val batch."""
        _, nll, count = self.sums(model, params, batch)
        return nll, count, {}

    @staticmethod
    def metrics(sums, count) -> dict:
        return {}


def translation_text(model, params, tokenizer, cfg) -> str | None:
    """train.sample_prompt as a source and its greedy target (the run's sample), as
    'source -> target'; None when the prompt is empty or longer than max_seq_len."""
    t = cfg.train
    source = np.asarray(tokenizer.encode(t.sample_prompt), np.int32)[None]
    new = min(t.sample_tokens, cfg.model.max_seq_len - 1)
    if source.shape[1] == 0 or source.shape[1] > cfg.model.max_seq_len or new < 1:
        return None
    end = end_id(tokenizer)
    out = seq2seq_generate(model, params, source, bos_id=end, eos_id=end, max_new_tokens=new)
    tokens = np.asarray(out.tokens[0, :int(out.lengths[0])])
    return f"{t.sample_prompt} -> {tokenizer.decode(tokens[tokens != end])}"
