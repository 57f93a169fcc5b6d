"""objective.name=grpo: group-relative policy optimization (Shao et al. 2024) with the
KV-cached sampler inside the step (training/grpo_step.py; its loss training/grpo.py).

Settings: beta, the k3 KL weight (0: no reference at all); group_size completions per
prompt (train.batch_size prompts a step), sampled at temperature up to max_new_tokens
(the ratio and KL read the model's own, temperature-1 log-probs: a temperature other than
1 samples off-policy); reward task:NAME (training/rewards.py) or MODULE:FUNCTION of
(prompt, completion) -> float; inner_steps optimizer steps per rollout; clip / clip_high
the ratio's range [1 - clip, 1 + clip_high] (None: clip); rollout: where the completions
are sampled (grpo_step.ROLLOUTS: "generate" inside the jitted step, "engine" through the
serving engine before it); temperature 0 samples greedily (each group's completions
alike: for checks, not training)."""

from __future__ import annotations

import dataclasses

from jaxformer.core.validation import ConfigError, check_choice, check_number
from jaxformer.training.grpo_step import ROLLOUTS, GroupPolicy
from jaxformer.training.objectives.entry import Objective, dense_only, fixed_name

METRICS = ("reward_mean", "reward_std", "completion_len", "ratio_first", "ratio_mean",
           "clip_fraction", "kl", "rollout_s", "reward_s", "update_s",
           "rollout_tokens_per_s", "update_tokens_per_s")  # grpo_step's, per step


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """objective.name=grpo: the module docstring's settings, each checked here."""

    name: str = fixed_name("grpo")
    beta: float = 0.1
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 16
    reward: str | None = None
    inner_steps: int = 1
    clip: float = 0.2
    clip_high: float | None = None
    rollout: str = "generate"

    def __post_init__(self):
        o = "objective"
        check_number(o, "beta", self.beta, float, low=0)
        check_number(o, "group_size", self.group_size, int, low=2)
        check_number(o, "temperature", self.temperature, float, low=0)
        check_number(o, "max_new_tokens", self.max_new_tokens, int, low=1)
        check_number(o, "inner_steps", self.inner_steps, int, low=1)
        check_number(o, "clip", self.clip, float, low=0, low_open=True, high=1, high_open=True)
        check_number(o, "clip_high", self.clip_high, float, low=0, low_open=True, optional=True)
        check_choice(o, "rollout", self.rollout, ROLLOUTS)
        if not isinstance(self.reward, str) or ":" not in self.reward:
            raise ConfigError(f"objective.name=grpo needs objective.reward (got {self.reward!r}): "
                              "task:NAME (task:addition, task:copy, task:exact) or "
                              "MODULE:FUNCTION, a Python function of (prompt, completion) -> float")


ENTRY = Objective(
    settings=GRPOSettings,
    build=lambda cfg, tokenizer: GroupPolicy(cfg),  # checks its reward now, before the data
    batches={"decoder": ("completions",)},  # it samples answers to their prompts
    metrics=METRICS, perplexity=True,  # the val answers' cross entropy
    reference=lambda settings: settings.beta > 0, starts_from=True, rollout=True,
    check=lambda cfg: dense_only(cfg, grad_accum=True), loss_chunk=True)
