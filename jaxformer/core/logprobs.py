"""Per-token log-probabilities: of chosen tokens under logits (the one log-softmax the LM
loss, the decoders' sampled-token log-probs and the post-training objectives share), and
of whole sequences teacher-forced through the training forward.

The parity contract: the log-probs `jaxformer.decode.loops.generate` returns for the tokens
it sampled equal `token_logprobs` of prompt + completion under the same params, for any
batch composition (a row alone, among other rows, padded wider, packed with other
sequences), so a rollout's log-probs can stand for the old policy in a PPO/GRPO ratio
(jaxformer.training.grpo) and the ratio starts at 1. On CPU float32 the equality is not
bitwise; tests/decode/test_logprob_parity.py asserts |difference| < 1e-5 (measured <= 9.5e-7,
a few float32 ulps of log-probs of size 1-8, on each composition, rope and ALiBi). Traced
layer by layer, the first difference is in attention's output (the q, k and v going in
are identical); everything after it only carries it on:

- prefill and incremental decoding attend through the KV cache (kv_cache.cached_attention:
  rows of [B * K, G * T, H] against every cache slot, empty ones masked), the training
  forward through its backend (on CPU `chunked`: [B, K, G, T, H] blocks of query rows,
  each reading the keys up to its last row): the same sums, in another order;
- XLA:CPU emits a batched matmul with a size-1 batch axis (one row) as a plain matmul and
  blocks it differently: even the training forward of a row alone and the same row among
  others differ by ~1e-6 (padded wider or packed behind other documents, with positions
  and segment ids given, the row's logits stayed bitwise those of the row alone given
  them, at the widths and offsets tried; without positions, by index, they differ);
- the decoders compile with CPU_DECODE_OPTIONS (512-bit vectors where the CPU has them).

The log-softmax itself is one function (target_logprobs) on both sides, so it adds
nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def target_logprobs(logits, targets):
    """log p(targets) under softmax(logits): logits [..., V] (as float32), targets int [...]
    -> float32 [...]. The negated cross entropy of the LM loss (optax's), the same float
    operations, so the loss and these log-probs cannot drift apart."""
    return -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def token_logprobs(model, params, tokens, positions=None, segment_ids=None):
    """Teacher-forced log-probs of `tokens` [B, T] under the training forward
    (model.apply, deterministic): float32 [B, T] aligned with the tokens, out[b, t] =
    log p(tokens[b, t] | the tokens before it in its segment).

    positions / segment_ids [B, T] as the model takes them (packing: positions restart and
    segment ids change at each document; segment id 0 is padding). A segment's first
    token, and padding, have no context and get 0: mask them out of a loss (a completion's
    mask covers its own tokens, each conditioned on what precedes it)."""
    logits = model.apply({"params": params}, tokens, positions=positions,
                         segment_ids=segment_ids)  # [B, T, V] float32
    return aligned(target_logprobs(logits[:, :-1], tokens[:, 1:]), segment_ids)


def aligned(logp, segment_ids=None):
    """The log-probs of tokens 1 .. T - 1 [B, T - 1] aligned with the tokens [B, T]
    (token_logprobs): 0 at the first token, at a segment's first and at padding."""
    if segment_ids is not None:  # a token after another segment's has no context here
        same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
        logp = jnp.where(same, logp, 0.0)
    return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)
