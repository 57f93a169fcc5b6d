"""GRPO's step cost, in its two forms (training/grpo_step.py), from the metrics a run logs:

- the reward as Python on the host (objective.reward=MODULE:FUNCTION, here
  jaxformer.training.rewards:addition): rollout tokens/s, update tokens/s (completion
  tokens sampled, and completion tokens x inner_steps trained on, per second), and the
  share of a step spent in the rollout (jitted generate), the reward (host Python) and
  the update (jitted inner_steps of the loss);
- the same reward as task:addition: rollout, reward and update one jitted program, its
  step seconds (the loop's tokens/s over the step's train.batch_size x seq_len);
- the host form again with objective.rollout=engine: the rollout through the serving
  engine (continuous batching over a paged KV cache) instead of generate; its stages.

    python bench/posttrain.py [--d-model 64 --layers 2 --prompts 16 --group 8
        --new 5 --inner 2 --steps 12 --temperature 1.0]

A one-step fine-tune on 2-digit addition records (jaxformer.experiments.grpo_addition)
gives the starting weights; then --steps GRPO steps with task:addition. Reports the
median over the steps after the first two (compilation). Prints a table; asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a checkout's own

from jaxformer.data.tokenizer import train_bpe  # noqa: E402
from jaxformer.experiments.grpo_addition import COMMON, records  # noqa: E402
from jaxformer.training import load_config, train  # noqa: E402
from jaxformer.training.metrics import read_metrics  # noqa: E402

SEQ_LEN = 32  # train.seq_len in COMMON: the loop's tokens/s counts batch_size x SEQ_LEN


def run(args, tmp: pathlib.Path) -> dict[str, list[dict]]:
    data = tmp / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records(2000, np.random.default_rng(0))))
    train_bpe(iter("0123456789+="), 257).save(tmp)
    base = [*COMMON, f"data.path={data}", f"data.cache_dir={tmp / 'cache'}"]
    model = ["model.preset=tiny", f"model.d_model={args.d_model}",
             f"model.n_layers={args.layers}", f"model.n_heads={max(1, args.d_model // 16)}",
             "model.max_seq_len=32", "model.vocab_size=257"]
    quiet = lambda *a: None  # noqa: E731
    train(load_config(None, [*model, *base, f"data.tokenizer={tmp / 'tokenizer.json'}",
                             "train.steps=1", "train.batch_size=8",
                             f"train.run_dir={tmp / 'sft'}"]), log=quiet)
    out = {}
    for form, reward, rollout in (("host", "jaxformer.training.rewards:addition", "generate"),
                                  ("one", "task:addition", "generate"),
                                  ("engine", "jaxformer.training.rewards:addition", "engine")):
        train(load_config(None, [
            f"objective.rollout={rollout}", f"objective.temperature={args.temperature}",
            *base, "model.max_seq_len=32", f"train.init_from={tmp / 'sft'}",
            "objective.name=grpo", f"objective.reward={reward}",
            f"objective.group_size={args.group}", f"objective.max_new_tokens={args.new}",
            f"objective.inner_steps={args.inner}", f"train.batch_size={args.prompts}",
            f"train.steps={args.steps}", "train.log_every=1",
            f"train.run_dir={tmp / form}"]), log=quiet)
        out[form] = [r for r in read_metrics(tmp / form) if "reward_mean" in r][2:]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=5)
    p.add_argument("--inner", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        forms = run(args, pathlib.Path(tmp))
    steps = forms["host"]
    med = lambda k: statistics.median(r[k] for r in steps)  # noqa: E731
    total = med("rollout_s") + med("reward_s") + med("update_s")
    print(f"GRPO step, d_model {args.d_model} x {args.layers} layers, {args.prompts} prompts x "
          f"{args.group} completions, <= {args.new} new tokens, {args.inner} inner steps "
          f"(median of {len(steps)} steps)")
    print(f"{'stage':<10}{'seconds':>10}{'share':>8}{'tokens/s':>12}")
    for stage, rate in (("rollout", med("rollout_tokens_per_s")), ("reward", None),
                        ("update", med("update_tokens_per_s"))):
        s = med(f"{stage}_s")
        print(f"{stage:<10}{s:>10.4f}{s / total:>8.1%}" + (f"{rate:>12,.0f}" if rate else ""))
    one = statistics.median(args.prompts * SEQ_LEN / r["tokens_per_s"] for r in forms["one"])
    made = statistics.median(r["completion_len"] for r in forms["one"]) * args.prompts * args.group
    print(f"{'host total':<10}{total:>10.4f}")
    engine = {k: statistics.median(r[k] for r in forms["engine"])
              for k in ("rollout_s", "reward_s", "update_s", "rollout_tokens_per_s")}
    e_total = engine["rollout_s"] + engine["reward_s"] + engine["update_s"]
    print(f"{'engine':<10}{engine['rollout_s']:>10.4f}{engine['rollout_s'] / total:>8.1%}"
          f"{engine['rollout_tokens_per_s']:>12,.0f}  (objective.rollout=engine: its rollout; "
          "share: of the host form's step)")
    print(f"{'eng total':<10}{e_total:>10.4f}{e_total / total:>8.1%}")
    print(f"{'one program':<10}{one:>10.4f}{one / total:>8.1%}{made / one:>12,.0f}  "
          f"(task:addition, one jitted step: its share is of the host form's "
          f"step; tokens/s: sampled per step second)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
