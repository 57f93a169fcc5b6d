"""GRPO's loss (jaxformer.training.grpo) against a float64 NumPy computation of its
formula: group-normalised advantages, the asymmetrically clipped surrogate, the k3 KL
penalty and token-level averaging; the loss and its gradient, for one group and for a
batch of groups, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.core.logprobs import token_logprobs
from jaxformer.training.grpo import group_advantages, grpo_loss

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture
CLIP, CLIP_HIGH = 0.2, 0.28


def np_advantages(rewards, group_ids, std, eps=1e-4):
    r = np.asarray(rewards, np.float64)
    out = np.empty_like(r)
    for g in np.unique(group_ids):
        sel = group_ids == g
        centred = r[sel] - r[sel].mean()
        if std == "none":
            out[sel] = centred
        else:
            out[sel] = centred / (r[sel].std(ddof=1 if std == "sample" else 0) + eps)
    return out


def np_grpo(new, old, ref, mask, adv, clip, clip_high, beta):
    """float64 (loss, d loss / d new) of the formula, the gradient written out: the
    surrogate's is ratio * A where the unclipped term is the minimum, else 0 (the clipped
    term is constant there); k3's is 1 - exp(ref - new)."""
    new, old, ref, mask = (np.asarray(x, np.float64) for x in (new, old, ref, mask))
    a = np.asarray(adv, np.float64)[:, None]
    ratio = np.exp(new - old)
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - clip, 1 + clip_high) * a
    d = ref - new
    per_token = -np.minimum(unclipped, clipped) + beta * (np.exp(d) - d - 1)
    count = mask.sum()
    grad = mask * (-np.where(unclipped <= clipped, ratio * a, 0.0)
                   + beta * (1 - np.exp(d))) / count
    return (per_token * mask).sum() / count, grad


def draw(groups, size, t=12):
    """Log-probs of `groups` x `size` completions of up to t tokens (ratios spread past
    both clips), their masks, rewards and shuffled group ids."""
    n = groups * size
    old = -rng.gamma(2.0, 1.0, (n, t))
    new = old + rng.normal(0, 0.5, (n, t))
    ref = old + rng.normal(0, 0.3, (n, t))
    lengths = rng.integers(4, t + 1, n)
    mask = (np.arange(t) < lengths[:, None]).astype(np.float32)
    group_ids = rng.permutation(np.repeat(np.arange(groups), size))
    rewards = np.round(rng.normal(0, 1, n), 1)  # with ties
    return [x.astype(np.float32) for x in (new, old, ref)], mask, rewards, group_ids


@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_advantages_are_normalised_within_each_group(std):
    rewards = rng.normal(0, 2, 24).astype(np.float32)
    group_ids = rng.permutation(np.repeat(np.arange(4), 6))
    got = group_advantages(rewards, jnp.asarray(group_ids), 4, std=std)
    np.testing.assert_allclose(got, np_advantages(rewards, group_ids, std), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("groups, beta, std", [(1, 0.0, "sample"), (1, 0.04, "none"),
                                               (5, 0.04, "sample"), (5, 0.0, "population")])
def test_loss_and_gradient_equal_a_float64_reference(groups, beta, std):
    for _ in range(5):  # both clips bind somewhere, or the test would not see them: in a
        # group of 8 one binds nowhere in ~1 of 1,250 draws (16 of 20,000), drawn again
        (new, old, ref), mask, rewards, group_ids = draw(groups, 8)
        ratio = np.exp(new - old)
        a = np_advantages(rewards, group_ids, std)[:, None] * np.ones_like(new)
        on = mask > 0
        if np.any(on & (ratio > 1 + CLIP_HIGH) & (a > 0)) and \
                np.any(on & (ratio < 1 - CLIP) & (a < 0)):
            break
    else:
        pytest.fail("no draw of 5 bound both clips")
    adv = group_advantages(rewards, jnp.asarray(group_ids), groups, std=std)
    np.testing.assert_allclose(adv, np_advantages(rewards, group_ids, std), rtol=1e-5,
                               atol=1e-6)

    def loss(new):
        return grpo_loss(new, old, ref if beta else None, mask, adv, clip=CLIP,
                         clip_high=CLIP_HIGH, beta=beta)

    (got, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(new))
    want, want_grad = np_grpo(new, old, ref, mask, np.asarray(adv), CLIP, CLIP_HIGH, beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    a = np.asarray(adv)[:, None] * np.ones_like(new)
    clipped = np.clip(ratio, 1 - CLIP, 1 + CLIP_HIGH) * a < ratio * a
    np.testing.assert_allclose(metrics["clip_fraction"], (clipped * mask).sum() / mask.sum(),
                               rtol=1e-6)


def test_at_old_equal_new_the_ratio_is_one_and_nothing_clips():
    (new, _, ref), mask, rewards, group_ids = draw(3, 4)
    adv = group_advantages(rewards, jnp.asarray(group_ids), 3)
    loss = lambda x: grpo_loss(x, new, ref, mask, adv, clip=1e-3, clip_high=1e-3,  # noqa: E731
                               beta=0.0)
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(new))
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0
    # the unclipped policy gradient: -A per completion token, averaged over the tokens
    want = -np.asarray(adv, np.float64)[:, None] * mask / mask.sum()
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(value, float((want * mask.sum()).sum() / mask.sum()), atol=1e-6)


def test_gradient_through_a_model_is_the_policy_gradient_at_ratio_one():
    """Through a tiny model's params, at the rollout's own params (new == old), GRPO's
    gradient is the token-averaged policy gradient -sum(A grad log p) / tokens."""
    cfg = ModelConfig(vocab_size=19, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        jnp.zeros((1, 4), jnp.int32))["params"]
    tokens = jnp.asarray(rng.integers(0, 19, (4, 10)), jnp.int32)
    mask = jnp.asarray(np.arange(10) >= rng.integers(2, 8, (4, 1)), jnp.float32)
    adv = group_advantages(rng.normal(0, 1, 4), jnp.asarray([0, 0, 1, 1]), 2)
    old = token_logprobs(model, params, tokens)

    def grpo(p):
        return grpo_loss(token_logprobs(model, p, tokens), old, None, mask, adv)[0]

    def policy_gradient(p):
        logp = token_logprobs(model, p, tokens)
        return -jnp.sum(adv[:, None] * logp * mask) / jnp.sum(mask)

    got, want = jax.jit(lambda p: (jax.grad(grpo)(p), jax.grad(policy_gradient)(p)))(params)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got, want)
