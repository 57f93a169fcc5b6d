"""Evaluate a jaxformer run (or an HF folder) on lm-evaluation-harness tasks:

    python -m jaxformer.eval RUN_DIR|RUN_DIR@STEP|HF_DIR --tasks T1,T2 [--include_path DIR]
        [--limit N] [--batch_size B] [--num_fewshot K] [--output results.json]
        [--matmul_precision fp8_rowwise]

(--batch-size, --include-path, --num-fewshot, --max-gen-toks and --matmul-precision are
accepted too.)

Prints lm-eval's results table and writes its results, with every example's requests and
responses ("samples"), as JSON to --output (default: RUN_DIR/lm_eval.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

EXTRA = "jaxformer.eval needs lm-evaluation-harness: pip install 'jaxformer[eval]'"


LOWEST = {"batch_size": 1, "num_fewshot": 0, "max_gen_toks": 1}  # flag -> its least value


def flag(p, name: str, **kw):
    """An option spelled as lm-eval spells it (--batch_size) and with hyphens (--batch-size)."""
    p.add_argument(name, name.replace("_", "-"), **kw)


def parse_args(argv):
    from jaxformer.core.low_precision import MATMUL_PRECISIONS
    p = argparse.ArgumentParser(prog="python -m jaxformer.eval",
                                description="Run lm-evaluation-harness tasks on a jaxformer "
                                "run dir (RUN or RUN@STEP) or a Hugging Face folder.")
    p.add_argument("model", help="a run dir (train.run_dir), RUN@STEP, or an HF model folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    flag(p, "--include_path", default=None, help="a folder of extra task YAMLs")
    p.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction)")
    flag(p, "--batch_size", type=int, default=8)
    flag(p, "--num_fewshot", type=int, default=None)
    flag(p, "--max_gen_toks", type=int, default=256)
    p.add_argument("--best", action="store_true", help="a run's best checkpoint, not its latest")
    p.add_argument("--engine", action="store_true", help="generate_until through the serving "
                   "engine (continuous batching over --batch_size slots)")
    p.add_argument("--output", default=None, help="the results JSON (default MODEL/lm_eval.json)")
    flag(p, "--matmul_precision", default=None, choices=tuple(MATMUL_PRECISIONS),
         help="the weight matmuls' precision (default: the model's)")
    return p.parse_args(argv)


def flag_problem(args) -> str | None:
    """What is wrong with the numbers given, in one line naming the flag; None when nothing."""
    limit = args.limit
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and limit.is_integer())):
        return f"--limit must be > 0 (a count, or a fraction below 1), got {limit:g}"
    for name, low in LOWEST.items():
        value = getattr(args, name)
        if value is not None and value < low:
            return f"--{name} must be >= {low}, got {value}"
    return None


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
    from huggingface_hub.errors import LocalEntryNotFoundError  # not cached, and offline
    from lm_eval import simple_evaluate

    from jaxformer.eval.lm import JaxformerLM

    lm = JaxformerLM(args.model.rstrip("/"), batch_size=args.batch_size,
                     max_gen_toks=args.max_gen_toks, best=args.best,
                     engine=getattr(args, "engine", False),
                     matmul_precision=getattr(args, "matmul_precision", None))
    names = [t for t in args.tasks.split(",") if t]
    tasks = task_manager(args.include_path, names)
    unknown = [n for n in names
               if n not in tasks.all_tasks and not pathlib.Path(n).expanduser().is_file()]
    if unknown:
        raise ValueError(f"unknown task {', '.join(unknown)}: not a registered lm-eval task, "
                         "group or tag name, nor a task YAML file; check the name, or pass "
                         "--include_path DIR for local task YAMLs")
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    try:
        return simple_evaluate(model=lm, tasks=names, task_manager=tasks, limit=limit,
                               num_fewshot=args.num_fewshot, log_samples=True)
    except (ConnectionError, LocalEntryNotFoundError) as e:
        raise ValueError(f"--tasks {args.tasks} needs a dataset from the Hugging Face Hub, "
                         f"which cannot be reached ({' '.join(str(e).split())}); download it "
                         "into the datasets cache first, or run local tasks with "
                         "--include_path DIR") from e


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = flag_problem(args)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        problem = problem or EXTRA
    if problem:
        print(f"error: {problem}", file=sys.stderr)
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
