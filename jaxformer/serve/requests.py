"""A request to the serving engine: its settings (checked at submission, each problem
named in one line with its fix), the events the engine reports for it, and its state
while it waits or runs: its tokens, the pages holding their keys, and the tokens its
constraints ban next (min_tokens, no_repeat_ngram: jaxformer.decode.constraints' meaning)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

TOP_LOGPROBS = 20  # the most alternatives a token's log-probs list (settings.logprobs)


@dataclasses.dataclass(frozen=True)
class RequestSettings:
    """One request's settings, checked by Engine.submit."""
    max_tokens: int = 16               # new tokens at most
    temperature: float = 1.0           # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None            # same seed -> same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()   # ends the request (emitted, finish "stop")
    min_tokens: int = 0                # no stop token before this many (min-length)
    no_repeat_ngram: int = 0           # the n-gram ban of jaxformer.decode.constraints (0: off)
    logprobs: int = 0                  # >0: also the top-`logprobs` alternatives per token


class Event(NamedTuple):
    """What Engine.step reports: one per new token, or an end without one."""
    request_id: int
    token: int                         # -1 on an end without a token (cancelled)
    logprob: float                     # log p(token) under the model (its raw log-softmax)
    top: tuple[tuple[int, float], ...]  # the top alternatives when settings.logprobs > 0
    finished: str | None               # None, "stop", "length", "cancelled"


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def settings_problem(s: RequestSettings, vocab: int) -> str | None:
    """The first thing wrong with settings s, in words with the fix, or None."""
    number = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool) \
        and math.isfinite(x)  # noqa: E731
    rules = [
        ("max_tokens", _integer(s.max_tokens) and s.max_tokens >= 1, "an integer >= 1"),
        ("temperature", number(s.temperature) and s.temperature >= 0, ">= 0 (0: greedy)"),
        ("top_k", _integer(s.top_k) and 0 <= s.top_k <= vocab,
         f"an integer in [0, {vocab}] (0: off)"),
        ("top_p", number(s.top_p) and 0 < s.top_p <= 1, "in (0, 1] (1: off)"),
        ("min_p", number(s.min_p) and 0 <= s.min_p <= 1, "in [0, 1] (0: off)"),
        ("seed", s.seed is None or (_integer(s.seed) and 0 <= s.seed < 2**64),
         "None or an integer in [0, 2**64)"),
        ("stop_token_ids", isinstance(s.stop_token_ids, (tuple, list)) and all(
            _integer(t) and 0 <= t < vocab for t in s.stop_token_ids),
         f"a tuple of token ids in [0, {vocab})"),
        ("min_tokens", _integer(s.min_tokens) and s.min_tokens >= 0, "an integer >= 0"),
        ("no_repeat_ngram", _integer(s.no_repeat_ngram) and s.no_repeat_ngram >= 0,
         "an integer >= 0 (0: off)"),
        ("logprobs", _integer(s.logprobs) and 0 <= s.logprobs <= TOP_LOGPROBS,
         f"an integer in [0, {TOP_LOGPROBS}]"),
    ]
    for name, ok, allowed in rules:
        if not ok:
            return f"settings.{name}={getattr(s, name)!r} is invalid; pass {allowed}"
    return None


def checked_request(prompt, settings, vocab: int, max_seq_len: int) -> list[int]:
    """The prompt as a list of ids, or a ValueError of one line naming the problem."""
    if not isinstance(settings, RequestSettings):
        raise ValueError(f"settings must be a RequestSettings, got {type(settings).__name__}")
    problem = settings_problem(settings, vocab)
    if problem:
        raise ValueError(problem)
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError("prompt must be a sequence of token ids (integers)") from None
    if not ids:
        raise ValueError("the prompt is empty; pass at least one token id")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}) (the vocabulary); got "
                         f"min {min(ids)}, max {max(ids)}")
    if len(ids) + settings.max_tokens > max_seq_len:
        raise ValueError(f"prompt length {len(ids)} + max_tokens {settings.max_tokens} = "
                         f"{len(ids) + settings.max_tokens} exceeds the model's max_seq_len="
                         f"{max_seq_len}; shorten the prompt or lower max_tokens")
    return ids


@dataclasses.dataclass(eq=False)
class Request:
    """A request's state. tokens: its prompt, then the tokens generated; held: how many of
    them have their keys in its pages (the next forward feeds tokens[held:]); pages: its
    page ids in logical order (its first `dropped` released: behind every layer's window);
    hashes: the chain hashes of its full pages (pages.py)."""
    id: int
    settings: RequestSettings
    tokens: list[int]
    prompt_len: int
    seed: tuple[int, int]  # its key stream's seed: low, high 32 bits
    held: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    hashes: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    ngrams: dict = dataclasses.field(default_factory=dict)  # (n - 1)-gram -> next tokens

    def __post_init__(self):
        for i in range(len(self.tokens)):
            self.record(i)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def record(self, i: int) -> None:
        """The n-gram ending at token i is seen (no_repeat_ngram > 0)."""
        n = self.settings.no_repeat_ngram
        if n and i >= n - 1:
            self.ngrams.setdefault(tuple(self.tokens[i - n + 1:i]), set()).add(self.tokens[i])

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.record(len(self.tokens) - 1)

    def bans(self) -> set[int]:
        """The tokens it may not emit next: its stop tokens before min_tokens, and those
        completing an n-gram it already holds (prompt included)."""
        s, banned = self.settings, set()
        if self.generated < s.min_tokens:
            banned |= set(s.stop_token_ids)
        n = s.no_repeat_ngram
        if n and len(self.tokens) >= n - 1:
            banned |= self.ngrams.get(tuple(self.tokens[len(self.tokens) - n + 1:]), set())
        return banned

    def finish_reason(self) -> str | None:
        """"stop" after a stop token, "length" at max_tokens, else None."""
        if self.generated and self.tokens[-1] in self.settings.stop_token_ids:
            return "stop"
        return "length" if self.generated >= self.settings.max_tokens else None
