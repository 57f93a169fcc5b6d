"""Length generalisation on synthetic tasks: for every positional scheme and task, one model
trained on examples of 1..study.train_max_len input symbols, then scored by exact match of
greedy decoding on examples up to several times longer.

    python -m jaxformer.experiments.length_gen [configs/experiments/length_gen.yaml]
        [--seeds N] [--out DIR] [--small] [section.key=value ...]

Sections: study.* (LengthGenSettings), model.* (ModelConfig fields, or model.preset; not
position, rope_scaling, max_seq_len or vocab_size, which the study sets), optim.*, and
train.steps / batch_size / seq_len (the packed row length) / seed / log_every.

Tasks (jaxformer.experiments.tasks): copy, reverse and addition with reversed digits. The
loss is on the answer tokens only; examples are packed several to a row, each a segment of
its own (attention stays inside it) whose positions restart at 0, so every scheme sees
each example start at position 0, in training and in evaluation alike.

Evaluation: greedy decoding reproduces an answer exactly iff at every answer token, given
the correct tokens before it, the argmax of the logits is that token (ties aside). So one
teacher-forced forward pass over packed examples scores them all, for every seed at once.
The seeds train as one vmapped program (jaxformer.experiments.seeds). The learned table has
train.seq_len rows: an example longer than that has no score (null, "n/a").
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.core.validation import check_choice, check_number
from jaxformer.data.random_positions import randomize_batch
from jaxformer.experiments import tasks
from jaxformer.experiments.length_gen_report import summarize, write_outputs
from jaxformer.experiments.positions_config import (COLUMNS, check_run_sections,
                                                    check_settings, column_fields, column_model,
                                                    read_sections, settings_from_dict, study_dict,
                                                    study_main)
from jaxformer.experiments.seeds import train_seeds
from jaxformer.model.build import count_params
from jaxformer.model.config import ConfigError, ModelConfig, RopeScaling
from jaxformer.model.transformer import Transformer
from jaxformer.positions.schemes import POSITION_SCHEMES
from jaxformer.training.config import RunConfig

__all__ = ["DEFAULT_CONFIG", "SMALL", "LengthGenConfig", "LengthGenSettings", "exact_match",
           "load_config", "main", "run_study"]

DEFAULT_CONFIG = (pathlib.Path(__file__).resolve().parents[2] /
                  "configs/experiments/length_gen.yaml")
SECTIONS = ("study", "model", "optim", "train")
SET_BY_STUDY = {"position": "choose schemes with study.schemes",
                "rope_scaling": "every scheme trains and is scored unscaled",
                "max_seq_len": "it is train.seq_len for learned positions, and fits the "
                               "longest evaluation example for the others",
                "vocab_size": f"it is the tasks' vocabulary of {tasks.VOCAB_SIZE} tokens"}
# A run of well under a minute on a CPU (--small; tests and notebooks).
SMALL = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=24",
         "train.batch_size=8", "train.steps=60", "train.log_every=20", "optim.warmup_steps=5",
         "study.train_max_len=3", "study.eval_lengths=1,3,6,9", "study.eval_examples=16")
TRAIN_STREAM, EVAL_STREAM = 0, 1  # the training and evaluation examples' random streams


@dataclasses.dataclass(frozen=True)
class LengthGenSettings:
    """tasks: from jaxformer.experiments.tasks.TASKS; one model each per scheme and seed.
    schemes: the columns compared (positions_config.COLUMNS): model.position values (a
      scheme on the run's model; default: every one of POSITION_SCHEMES) or model variants
      (positions_config.MODEL_VARIANTS: hybrid-rope, gated_delta, mamba2, ...).
    train_max_len: training examples have 1..train_max_len input symbols, uniformly.
    eval_lengths: the input lengths scored (the same examples for every scheme and seed).
    eval_examples: examples scored at each length.
    eval_batch_tokens: tokens per evaluation forward pass (per seed).
    seeds: repeats with train.seed, train.seed + 1, ..., trained as one vmapped program.
    task_positions: the position ids the model reads (jaxformer.experiments.tasks):
      index (0, 1, 2, ...), coupled (Cho et al. 2024), abacus (McLeish et al. 2024).
    position_offset: coupled and abacus ids get a random offset in 0..position_offset per
      training example (none in evaluation), so ids past the training lengths are trained.
    eval_random_positions: with train.random_positions=MAX, score each example at a sorted
      random subset of [0, MAX) too, as Ruoss et al. evaluate (default: 0..n-1).
    out_dir: where results.json, results.md and length_gen.png are written.
    progress: print progress lines while it runs.
    """

    tasks: tuple[str, ...] = tasks.TASKS
    schemes: tuple[str, ...] = tuple(POSITION_SCHEMES)
    train_max_len: int = 8
    eval_lengths: tuple[int, ...] = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24)
    eval_examples: int = 100
    eval_batch_tokens: int = 16384
    seeds: int = 1
    task_positions: str = "index"
    position_offset: int = 0
    eval_random_positions: bool = False
    out_dir: str = "runs/length_gen"
    progress: bool = True

    def __post_init__(self):
        if not self.tasks or not self.schemes:
            name, allowed = ("tasks", tasks.TASKS) if not self.tasks else ("schemes", COLUMNS)
            raise ConfigError(f"study.{name} is empty; choose from {', '.join(allowed)}")
        check_settings(self, choices={"tasks": tasks.TASKS, "schemes": tuple(COLUMNS)},
                       increasing=("eval_lengths",),
                       positive=("train_max_len", "eval_examples", "eval_batch_tokens", "seeds"))
        check_choice("study", "task_positions", self.task_positions, tasks.TASK_POSITIONS)
        check_number("study", "position_offset", self.position_offset, int, low=0)

    @property
    def ordered(self) -> bool:
        """Whether the ids grow along each example (masks may read them)."""
        return self.task_positions == "index"


@dataclasses.dataclass(frozen=True)
class LengthGenConfig:
    study: LengthGenSettings
    run: RunConfig  # model (its position unused), optim, train

    def __post_init__(self):
        s, row = self.study, self.run.train.seq_len
        need = max(tasks.example_tokens(t, s.train_max_len) - 1 for t in s.tasks)
        if need > row:
            raise ConfigError(f"train.seq_len={row} cannot hold one training example of "
                              f"study.train_max_len={s.train_max_len} input symbols ({need} "
                              "tokens); raise train.seq_len or lower study.train_max_len")
        top = self.run.train.random_positions
        if s.eval_random_positions and top is None:
            raise ConfigError("study.eval_random_positions needs train.random_positions=MAX, "
                              "the range its positions are drawn from")
        if top is not None and not s.ordered:
            raise ConfigError(f"train.random_positions={top} with study.task_positions="
                              f"{s.task_positions}: both set the position ids; drop one")
        if not s.ordered and self.run.model.sliding_window is not None:
            raise ConfigError(f"study.task_positions={s.task_positions} ids are not in row "
                              "order, which a sliding window reads; drop model.sliding_window")
        for scheme in s.schemes:  # every model builds, before anything trains
            self.check_table(self.model_config(scheme))

    def row_len(self, scheme: str) -> int:
        """The evaluation rows' length: enough for the longest evaluation example (and no
        less than the training rows); for a learned table of index positions its size,
        the training rows' length (or the random positions it trains)."""
        longest = max(tasks.example_tokens(t, self.study.eval_lengths[-1]) - 1
                      for t in self.study.tasks)
        row = self.run.train.seq_len
        if POSITION_SCHEMES[COLUMNS[scheme].position].max_length is not None and \
                self.study.ordered:
            return max(row, self.run.train.random_positions or 0)
        return max(row, longest)

    def check_table(self, mcfg: ModelConfig):
        """A learned table holds every id trained (coupled/abacus ids with their offsets)."""
        longest = POSITION_SCHEMES[mcfg.position].max_length
        s = self.study
        top = max(int(tasks.example_positions(t, s.train_max_len, s.task_positions,
                                              s.position_offset).max()) for t in s.tasks)
        if longest is not None and top >= longest(mcfg):
            raise ConfigError(f"study.position_offset={s.position_offset} trains position ids up "
                              f"to {top}, past the {mcfg.position} table's {longest(mcfg)} rows; "
                              "lower it, or raise train.seq_len")

    def model_config(self, scheme: str) -> ModelConfig:
        """Column `scheme`'s model (positions_config.COLUMNS) on the tasks' vocabulary."""
        return column_model(scheme, self.run.model).replace(
            rope_scaling=RopeScaling(), vocab_size=tasks.VOCAB_SIZE,
            max_seq_len=self.row_len(scheme))

    def to_dict(self) -> dict[str, Any]:
        return study_dict(self.study, self.run, ("model", "optim"))


def load_config(path: str | None = None, overrides=()) -> LengthGenConfig:
    """A YAML file of sections (study, model, optim, train) with key=value overrides."""
    sections = read_sections(path, overrides, SECTIONS, "configs/experiments/length_gen.yaml")
    check_run_sections(sections, SET_BY_STUDY)
    study = settings_from_dict(LengthGenSettings, sections.pop("study"))
    return LengthGenConfig(study, RunConfig.from_dict(sections))


# ---- training and evaluation ----------------------------------------------------------

def train_rng(seed: int, task: str, step: int) -> np.random.Generator:
    return np.random.default_rng([TRAIN_STREAM, seed, tasks.TASKS.index(task), step])


def eval_positions(cfg: LengthGenConfig, task: str, lengths) -> list[np.ndarray] | None:
    """The evaluation examples' position ids, one per example length: the task's ids (no
    offset), or sorted random ones from [0, train.random_positions) (the same for every
    scheme and seed), or None for 0..n-1."""
    s, top = cfg.study, cfg.run.train.random_positions
    if s.eval_random_positions:
        rng = np.random.default_rng([EVAL_STREAM, tasks.TASKS.index(task), top])
        return [np.sort(rng.choice(top, tasks.example_tokens(task, n), replace=False))
                for n in lengths]
    if s.ordered:
        return None
    return [tasks.example_positions(task, n, s.task_positions) for n in lengths]


def eval_examples(task: str, length: int, count: int) -> list[np.ndarray]:
    """The examples scored at `length`: the same for every scheme, seed and config."""
    rng = np.random.default_rng([EVAL_STREAM, tasks.TASKS.index(task), length])
    return list(tasks.make_examples(task, length, count, rng))


@functools.lru_cache(maxsize=None)
def _predictor(mcfg: ModelConfig, ordered_positions: bool = True):
    """predict(stacked params [N, ...], batch) -> argmax token ids [N, B, T]: every seed's
    greedy choice at every position, given the true tokens before it."""
    model = Transformer(mcfg, ordered_positions=ordered_positions)

    def predict(params, batch):
        logits = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                             segment_ids=batch["segment_ids"])  # [B, T, V]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.jit(jax.vmap(predict, in_axes=(0, None)))


def exact_match(mcfg: ModelConfig, params, examples, answer_starts, row_len: int,
                batch_tokens: int, positions=None) -> np.ndarray:
    """bool [N, E]: whether greedy decoding from example e's prompt (its tokens before
    answer_starts[e]) gives exactly its answer, for each of the N stacked params.
    positions: each example's position ids (tasks.pack), None for index positions."""
    packed = tasks.pack(examples, answer_starts, row_len, positions=positions)
    rows = max(1, batch_tokens // row_len)
    n_rows = -(-len(packed["inputs"]) // rows) * rows  # padded: one shape for every batch
    packed = {k: np.pad(v, ((0, n_rows - len(v)), (0, 0)), constant_values=-1 if k == "example"
                        else 0) for k, v in packed.items()}
    predict, wrong = _predictor(mcfg, positions is None), []
    for i in range(0, n_rows, rows):
        batch = {k: packed[k][i:i + rows] for k in ("inputs", "positions", "segment_ids")}
        wrong.append(np.asarray(predict(params, batch)) != packed["targets"][i:i + rows])
    wrong = np.concatenate(wrong, axis=1) & (packed["loss_mask"] > 0)  # [N, R, T]
    answer = packed["example"] >= 0
    counts = [np.bincount(packed["example"][answer], weights=w[answer],
                          minlength=len(examples)) for w in wrong]
    return np.stack(counts) == 0


def accuracy(cfg: LengthGenConfig, mcfg: ModelConfig, params, task: str) -> list[list]:
    """[seed][length] exact-match accuracy on the evaluation examples; None where they do not
    fit the evaluation rows (beyond the learned table)."""
    s, row_len = cfg.study, cfg.row_len(mcfg.position)
    room = row_len + 1  # an example's tokens, at most: a row's inputs and its last target
    if s.eval_random_positions:  # and no more than the positions drawn from
        room = min(room, cfg.run.train.random_positions)
    fits = [n for n in s.eval_lengths if tasks.example_tokens(task, n) <= room]
    examples = [ex for n in fits for ex in eval_examples(task, n, s.eval_examples)]
    starts = [tasks.answer_start(task, n) for n in fits for _ in range(s.eval_examples)]
    ids = eval_positions(cfg, task, [n for n in fits for _ in range(s.eval_examples)])
    solved = exact_match(mcfg, params, examples, starts, row_len, s.eval_batch_tokens, ids)
    by_length = solved.reshape(len(solved), len(fits), s.eval_examples).mean(-1)  # [N, F]
    return [[float(by_length[i, fits.index(n)]) if n in fits else None
             for n in s.eval_lengths] for i in range(len(solved))]


def train_task(cfg: LengthGenConfig, mcfg: ModelConfig, task: str, seeds, log):
    """(stacked params of one model per seed on `task`, each seed's final train loss)."""
    s, t = cfg.study, cfg.run.train

    def batch(seed, step):
        rows = tasks.train_batch(task, s.train_max_len, t.batch_size, t.seq_len,
                                 train_rng(seed, task, step), s.task_positions, s.position_offset)
        return randomize_batch(rows, t.random_positions, seed, step)  # Ruoss et al., or none

    return train_seeds(mcfg, cfg.run.optim, t.steps, seeds, batch, log_every=t.log_every,
                       log=log, ordered_positions=s.ordered)


def _print(*args):
    print(*args, flush=True)  # progress shows at once, also through a pipe or into a file


def run_study(cfg: LengthGenConfig, *, log=_print) -> dict:
    """Train every (scheme, task) for every seed and score it at every length; the results."""
    s, t = cfg.study, cfg.run.train
    log = log if s.progress else (lambda *a, **k: None)
    seeds, started = [t.seed + i for i in range(s.seeds)], time.perf_counter()
    log(f"{len(s.schemes)} schemes x {len(s.tasks)} tasks x {len(seeds)} seed(s) (vmapped), "
        f"each {t.steps} steps of {t.batch_size} rows of {t.seq_len} tokens, lengths "
        f"1..{s.train_max_len}; {s.eval_examples} examples at each of lengths "
        f"{', '.join(map(str, s.eval_lengths))}")
    rows, train, params_count = {}, {}, {}
    for i, scheme in enumerate(s.schemes):
        mcfg = cfg.model_config(scheme)
        params_count[scheme] = count_params(mcfg)
        rows[scheme], train[scheme] = {}, {}
        for task in s.tasks:
            log(f"[{i + 1}/{len(s.schemes)}] {scheme}, {task}: {params_count[scheme]:,} params "
                f"({time.perf_counter() - started:.0f} s since the start)")
            t0 = time.perf_counter()
            params, losses = train_task(cfg, mcfg, task, seeds, log)
            acc = accuracy(cfg, mcfg, params, task)
            rows[scheme][task] = {"accuracy": acc}
            train[scheme][task] = {"loss": losses, "seconds": round(time.perf_counter() - t0, 1)}
            for seed, per_length in zip(seeds, acc):
                log(f"    seed {seed} exact match: " + "  ".join(
                    f"{n}: {'n/a' if a is None else f'{a:.2f}'}"
                    for n, a in zip(s.eval_lengths, per_length)))
    results = {"tasks": list(s.tasks), "seeds": seeds, "train_max_len": s.train_max_len,
               "eval_lengths": list(s.eval_lengths), "rows": rows,
               "eval_examples": s.eval_examples, "params": params_count, "train": train,
               "models": {name: column_fields(name, cfg.model_config(name)) for name in rows},
               "config": cfg.to_dict(), "seconds": round(time.perf_counter() - started, 1)}
    return summarize(results)


def main(argv=None) -> int:
    return study_main(argv, doc=__doc__, prog="python -m jaxformer.experiments.length_gen",
                      default_config=DEFAULT_CONFIG, small=SMALL, load=load_config,
                      run=run_study, write=write_outputs,
                      eval_lengths=("the input lengths scored, e.g. 1,2,4,8,16 "
                                    "(study.eval_lengths)", "study.eval_lengths={}".format))


if __name__ == "__main__":
    sys.exit(main())
