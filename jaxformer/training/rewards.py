"""GRPO's rewards (objective.reward): a score per sampled completion, computed on the host.

task:NAME, verifiable tasks scored by exact match (1.0 or 0.0) on the completion's first
line (its text up to the first newline: a byte-level tokenizer has no end-of-text token,
so records may end their completions with a newline), surrounding whitespace stripped:

- task:addition: the prompt ends with ``A+B=`` (decimal integers, anything before them);
  the completion must be A + B written out;
- task:copy: the prompt ends with ``X=`` (X: the text after the prompt's last space or
  newline); the completion must be X;
- task:exact: the completion must be the record's own completion (its reference answer).

MODULE:FUNCTION: a Python function of (prompt, completion) -> float (an int or a NumPy
number will do; bool, None, NaN or anything else stops the run naming the function).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re

from jaxformer.config import ConfigError

_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)\s*=\s*$")


def first_line(text: str) -> str:
    """The text up to its first newline, stripped: what the task rewards compare."""
    return text.split("\n", 1)[0].strip()


def addition(prompt: str, completion: str, answer: str | None = None) -> float:
    """1.0 when the completion is the sum the prompt's trailing ``A+B=`` asks for."""
    found = _SUM.search(prompt)
    return float(found is not None and
                 first_line(completion) == str(int(found.group(1)) + int(found.group(2))))


def copy(prompt: str, completion: str, answer: str | None = None) -> float:
    """1.0 when the completion repeats the prompt's last word before its trailing ``=``."""
    body = prompt.rstrip()
    if not body.endswith("="):
        return 0.0
    word = re.split(r"[ \n]", body[:-1])[-1]
    return float(first_line(completion) == word)


def exact(prompt: str, completion: str, answer: str | None = None) -> float:
    """1.0 when the completion is the record's reference answer."""
    return float(answer is not None and first_line(completion) == first_line(answer))


def _line(error) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split())


TASKS = {"addition": addition, "copy": copy, "exact": exact}


class Reward:
    """The reward objective.reward names, called as reward(prompts, completions, answers)
    -> list of floats; a function that raises or returns a non-number is a ConfigError
    naming it."""

    def __init__(self, spec: str):
        self.spec = spec
        kind, _, name = spec.partition(":")
        if kind == "task":
            if name not in TASKS:
                raise ConfigError(f"objective.reward={spec}: no such task; use one of "
                                  f"{', '.join('task:' + t for t in TASKS)} or MODULE:FUNCTION")
            self.fn, self.takes_answer = TASKS[name], True
            return
        try:
            self.fn = getattr(importlib.import_module(kind), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"objective.reward={spec} cannot be loaded ({type(e).__name__}: "
                              f"{_line(e)}); give MODULE:FUNCTION importable from the run's "
                              "PYTHONPATH, or task:NAME") from None
        if not callable(self.fn):
            raise ConfigError(f"objective.reward={spec} is not a function")
        self.takes_answer = False

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
