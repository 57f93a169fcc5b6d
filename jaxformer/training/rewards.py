"""GRPO's rewards (objective.reward): a score per sampled completion.

task:NAME, verifiable tasks scored by exact match (1.0 or 0.0) of the completion's first
line (its text up to the first newline: a byte-level tokenizer has no end-of-text token,
so records may end their completions with a newline), surrounding ASCII whitespace
(space, tab, CR, VT, FF) stripped, against a target the prompt (or the record) fixes:

- task:addition: the prompt ends with ``A+B=`` (decimal integers, anything before them);
  the target is A + B written out;
- task:copy: the prompt ends with ``X=`` (X: the text after the prompt's last space or
  newline); the target is X;
- task:exact: the target is the first line of the record's own completion (its reference
  answer).

A prompt without a target (no trailing ``A+B=``, say) scores 0. Since the target is known
before the rollout, a task reward also runs inside the jitted step, on token ids
(jaxformer.training.match: the same comparison on the completion's bytes).

MODULE:FUNCTION: a Python function of (prompt, completion) -> float (an int or a NumPy
number will do; bool, None, NaN or anything else stops the run naming the function),
called on the host between the rollout and the update.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re

from jaxformer.model.config import ConfigError

WHITESPACE = " \t\r\x0b\x0c"  # stripped around the first line ("\n" ends it)
_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)\s*=\s*$")


def first_line(text: str) -> str:
    """The text up to its first newline, stripped: what the task rewards compare."""
    return text.split("\n", 1)[0].strip(WHITESPACE)


def addition_target(prompt: str, answer: str | None = None) -> str | None:
    """A + B for a prompt ending in ``A+B=``, else None."""
    found = _SUM.search(prompt)
    return None if found is None else str(int(found.group(1)) + int(found.group(2)))


def copy_target(prompt: str, answer: str | None = None) -> str | None:
    """The prompt's last word before its trailing ``=``, else None."""
    body = prompt.rstrip()
    return re.split(r"[ \n]", body[:-1])[-1] if body.endswith("=") else None


def exact_target(prompt: str, answer: str | None = None) -> str | None:
    """The first line of the record's reference answer (None without one)."""
    return None if answer is None else first_line(answer)


TARGETS = {"addition": addition_target, "copy": copy_target, "exact": exact_target}


def _task(target):
    def score(prompt: str, completion: str, answer: str | None = None) -> float:
        want = target(prompt, answer)
        return float(want is not None and first_line(completion) == want)
    score.__name__ = target.__name__.removesuffix("_target")
    score.__doc__ = f"1.0 when the completion's first line is {target.__name__}'s target."
    return score


TASKS = {name: _task(target) for name, target in TARGETS.items()}
addition, copy, exact = TASKS["addition"], TASKS["copy"], TASKS["exact"]


def _line(error) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split())


class Reward:
    """The reward objective.reward names, called as reward(prompts, completions, answers)
    -> list of floats; a function that raises or returns a non-number is a ConfigError
    naming it. `target` is the task's target function (None for MODULE:FUNCTION)."""

    def __init__(self, spec: str):
        self.spec = spec
        kind, _, name = spec.partition(":")
        if kind == "task":
            if name not in TASKS:
                raise ConfigError(f"objective.reward={spec}: no such task; use one of "
                                  f"{', '.join('task:' + t for t in TASKS)} or MODULE:FUNCTION")
            self.fn, self.target, self.takes_answer = TASKS[name], TARGETS[name], True
            return
        try:
            self.fn = getattr(importlib.import_module(kind), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"objective.reward={spec} cannot be loaded ({type(e).__name__}: "
                              f"{_line(e)}); give MODULE:FUNCTION importable from the run's "
                              "PYTHONPATH, or task:NAME") from None
        if not callable(self.fn):
            raise ConfigError(f"objective.reward={spec} is not a function")
        self.target, self.takes_answer = None, False

    def __call__(self, prompts, completions, answers) -> list[float]:
        out = []
        for p, c, a in zip(prompts, completions, answers):
            try:
                r = self.fn(p, c, a) if self.takes_answer else self.fn(p, c)
            except Exception as e:  # noqa: BLE001 (any failure of the user's function)
                raise ConfigError(f"objective.reward={self.spec} raised {type(e).__name__}: "
                                  f"{_line(e)} (on prompt {p!r}, completion {c!r})") from None
            if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r):
                raise ConfigError(f"objective.reward={self.spec} returned {r!r} (on prompt "
                                  f"{p!r}); it must return a finite number")
            out.append(float(r))
        return out
