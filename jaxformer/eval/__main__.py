"""Evaluate a jaxformer run (or an HF folder) on lm-evaluation-harness tasks:

    python -m jaxformer.eval RUN_DIR|RUN_DIR@STEP|HF_DIR --tasks T1,T2 [--include_path DIR]
        [--limit N] [--batch_size B] [--num_fewshot K] [--output results.json]

Prints lm-eval's results table and writes its results, with every example's requests and
responses ("samples"), as JSON to --output (default: RUN_DIR/lm_eval.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

EXTRA = "jaxformer.eval needs lm-evaluation-harness: pip install 'jaxformer[eval]'"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxformer.eval",
                                description="Run lm-evaluation-harness tasks on a jaxformer "
                                "run dir (RUN or RUN@STEP) or a Hugging Face folder.")
    p.add_argument("model", help="a run dir (train.run_dir), RUN@STEP, or an HF model folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include_path", default=None, help="a folder of extra task YAMLs")
    p.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--max_gen_toks", type=int, default=256)
    p.add_argument("--best", action="store_true", help="a run's best checkpoint, not its latest")
    p.add_argument("--engine", action="store_true", help="generate_until through the serving "
                   "engine (continuous batching over --batch_size slots)")
    p.add_argument("--output", default=None, help="the results JSON (default MODEL/lm_eval.json)")
    return p.parse_args(argv)


def task_manager(include_path, names):
    """lm-eval's TaskManager: --include_path's tasks alone when they hold every name asked
    for (indexing lm-eval's own thousands of task files takes about 20 s), else with them."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    return TaskManager(include_path=include_path)


def evaluate(args) -> dict:
    """lm-eval's results dict (samples included) for parsed arguments."""
    from lm_eval import simple_evaluate

    from jaxformer.eval.lm import JaxformerLM

    lm = JaxformerLM(args.model.rstrip("/"), batch_size=args.batch_size,
                     max_gen_toks=args.max_gen_toks, best=args.best,
                     engine=getattr(args, "engine", False))
    names = [t for t in args.tasks.split(",") if t]
    tasks = task_manager(args.include_path, names)
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    return simple_evaluate(model=lm, tasks=names, task_manager=tasks, limit=limit,
                           num_fewshot=args.num_fewshot, log_samples=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print(f"error: {EXTRA}", file=sys.stderr)
        return 2
    from lm_eval.utils import handle_non_serializable, make_table

    from jaxformer.model.config import ConfigError
    from jaxformer.training.checkpoint import CheckpointError
    try:
        results = evaluate(args)
    except (ConfigError, FileNotFoundError, ValueError, KeyError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    out = pathlib.Path(args.output or pathlib.Path(args.model.split("@")[0]) / "lm_eval.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
