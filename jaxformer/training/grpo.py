"""GRPO's loss as a pure function of per-token log-probs (Shao et al. 2024, DeepSeekMath),
with DAPO's asymmetric clip (Yu et al. 2025) and Dr. GRPO's token averaging and optional
unscaled advantages (Liu et al. 2025).

For completion i of a group (the completions of one prompt) with reward r_i, and each of
its tokens t under the loss mask:

    A_i       = (r_i - mean_group(r)) / (std_group(r) + eps)      (std="none": r_i - mean)
    ratio_it  = exp(new_it - old_it)
    surrogate = min(ratio_it A_i, clip(ratio_it, 1 - clip, 1 + clip_high) A_i)
    kl_it     = exp(ref_it - new_it) - (ref_it - new_it) - 1       (Schulman's k3, >= 0)
    loss      = sum_it mask_it (beta kl_it - surrogate) / sum_it mask_it

`old` are the rollout's own log-probs (jaxformer.decode.loops.generate's, which equal the
training forward's: jaxformer.core.logprobs), so at the first inner step new == old, the ratio
is 1 and the clip is inactive. The average runs over every completion token of the batch
(DAPO's token-level loss; Dr. GRPO), not per sequence first. beta = 0 drops the KL term
and the reference's log-probs are not read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

STDS = ("sample", "population", "none")  # group_advantages' std: N - 1, N, or no scaling


def group_advantages(rewards, group_ids, num_groups: int, *, std: str = "sample",
                     eps: float = 1e-4):
    """Each completion's reward normalised within its group: (r - the group's mean) /
    (the group's std + eps). rewards float [N], group_ids int [N] in [0, num_groups).

    std: "sample" (Bessel's N - 1, as torch.std: TRL's GRPOTrainer, eps 1e-4 its
    default), "population" (N), or "none" (Dr. GRPO: r - mean, unscaled). A group of one
    completion has advantage 0 ("sample" needs >= 2 per group to scale)."""
    if std not in STDS:
        raise ValueError(f"std must be one of {', '.join(STDS)}, got {std!r}")
    rewards = jnp.asarray(rewards, jnp.float32)
    total = lambda x: jax.ops.segment_sum(x, group_ids, num_groups)[group_ids]  # noqa: E731
    count = total(jnp.ones_like(rewards))
    centred = rewards - total(rewards) / count
    if std == "none":
        return centred
    dof = count - 1 if std == "sample" else count
    spread = jnp.sqrt(total(centred ** 2) / jnp.maximum(dof, 1))
    return centred / (spread + eps)


def grpo_loss(new_logprobs, old_logprobs, ref_logprobs, loss_mask, advantages, *,
              clip: float = 0.2, clip_high: float | None = None, beta: float = 0.0):
    """(loss, metrics): the module docstring's loss, token-averaged over the batch.

    new_logprobs: float [N, T], the policy's per-token log-probs (differentiate through
    these); old_logprobs: the rollout's [N, T]; ref_logprobs: the reference model's [N, T]
    (read only when beta > 0; None then allowed); loss_mask [N, T]: 1 on completion tokens;
    advantages [N] (group_advantages). clip: the ratio's lower clip 1 - clip; clip_high:
    its upper 1 + clip_high (DAPO's clip-higher; None: clip). metrics: ratio_mean,
    clip_fraction (tokens whose clipped branch is the minimum and moves the loss), kl
    (the mean k3, 0 without beta); all over masked tokens."""
    clip_high = clip if clip_high is None else clip_high
    mask = jnp.asarray(loss_mask, jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    adv = jnp.asarray(advantages, jnp.float32)[:, None]  # [N, 1]
    ratio = jnp.exp(new_logprobs - old_logprobs)  # [N, T]
    bounded = jnp.clip(ratio, 1.0 - clip, 1.0 + clip_high)
    surrogate = jnp.minimum(ratio * adv, bounded * adv)
    per_token = -surrogate
    kl = jnp.zeros_like(ratio)
    if beta:
        d = ref_logprobs - new_logprobs
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + beta * kl
    mean = lambda x: jnp.sum(x * mask) / count  # noqa: E731
    clipped = (bounded * adv < ratio * adv).astype(jnp.float32)
    loss = mean(per_token)
    return loss, {"ratio_mean": mean(ratio), "clip_fraction": mean(clipped), "kl": mean(kl)}
