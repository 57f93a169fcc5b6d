"""The OpenAI API's shapes as this server speaks them: the request bodies of
/v1/completions and /v1/chat/completions (pydantic models), the RequestSettings they ask
of the engine, log-probs in the completions and the chat shapes, and errors as
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from jaxformer.serve.text_stream import TokenLogprob


class RequestError(Exception):
    """A request the server answers with an HTTP error and a one-line message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = (
            message, status, param, kind, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class Sampling(BaseModel):
    """The fields both routes share: the model, sampling, stop strings and streaming."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def refuse_unsupported(self) -> None:
        """A RequestError for what this server does not do (several choices, penalties)."""
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n}: this server returns one choice per request; send "
                               "n=1 (several requests for several choices)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported; leave it 0 (no_repeat_ngram_size "
                                   "bans repeats)", param=name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported; leave it out", param="logit_bias")

    def settings(self, end_ids: tuple[int, ...], max_tokens: int | None,
                 logprobs: int) -> dict:
        """The engine's RequestSettings fields this request asks for."""
        top_k = self.top_k if self.top_k is not None else 0
        return dict(max_tokens=16 if max_tokens is None else max_tokens,
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=0 if top_k == -1 else top_k,  # -1: off, as vLLM writes it
                    top_p=1.0 if self.top_p is None else self.top_p,
                    min_p=self.min_p or 0.0, seed=self.seed, stop_token_ids=end_ids,
                    min_tokens=self.min_tokens, no_repeat_ngram=self.no_repeat_ngram_size,
                    logprobs=logprobs)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def field_names(self) -> dict[str, str]:
        """The engine's setting names (its errors' words) -> this request's fields."""
        return {"max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
                "top_p": "top_p", "min_p": "min_p", "seed": "seed", "min_tokens": "min_tokens",
                "no_repeat_ngram": "no_repeat_ngram_size", "logprobs": "logprobs"}


class CompletionRequest(Sampling):
    """POST /v1/completions."""
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def prompt_one(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of several is refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(f"{len(p)} prompts in one request; send one prompt per "
                                   "request", param="prompt")
            p = p[0]
        return p

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise RequestError("echo=true is not supported; leave it false", param="echo")
        if self.best_of not in (None, 1):
            raise RequestError(f"best_of={self.best_of} is not supported; leave it 1",
                               param="best_of")
        if self.suffix:
            raise RequestError("suffix is not supported; leave it out", param="suffix")


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Besides Sampling's: tools and structured output, which would change what the
        reply is rather than be quietly left out."""
        super().refuse_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise RequestError(f"{name} are not supported: this server answers with text "
                                   f"alone; leave {name} out", param=name)
        kinds = {(self.response_format or {}).get("type", "text")} - {"text"}
        if kinds:
            raise RequestError(f"response_format type {kinds.pop()!r} is not supported: this "
                               "server answers with free text; leave response_format out",
                               param="response_format")

    def field_names(self) -> dict[str, str]:
        given = "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"
        return {**super().field_names(), "max_tokens": given, "logprobs": "top_logprobs"}

    def plain_messages(self) -> list[dict[str, Any]]:
        """The messages with content given as parts ([{"type": "text", "text": ...}])
        joined into one string; parts other than text are refused."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict):
                        raise RequestError(
                            f"messages[{i}].content[{j}] is {type(part).__name__} {part!r:.40}; "
                            "send each part as an object, {\"type\": \"text\", \"text\": ...}",
                            param="messages")
                kinds = {part.get("type") for part in content} - {"text"}
                if kinds:
                    raise RequestError(f"messages[{i}] holds {sorted(kinds)} parts; this "
                                       "model reads text alone", param="messages")
                content = "".join(part.get("text", "") for part in content)
            out.append({**m, "content": content})
        return out


def completion_logprobs(tokens: list[TokenLogprob], decode) -> dict:
    """Log-probs in the completions shape (text_offset: where each token's text starts in
    the completion; the bytes of one character all start where the character does)."""
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_by_text(t.top, decode) for t in tokens],
            "text_offset": [t.offset for t in tokens]}


def _by_text(top, decode) -> dict[str, float]:
    """{token text: log-prob} of the alternatives, the likeliest kept where two tokens
    read the same (bytes of an unfinished character)."""
    out: dict[str, float] = {}
    for i, lp in top:
        out.setdefault(decode([i]), lp)
    return out


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[TokenLogprob], decode) -> dict:
    """Log-probs in the chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**_chat_entry(t.text, t.logprob),
                         "top_logprobs": [_chat_entry(decode([i]), lp) for i, lp in t.top]}
                        for t in tokens]}
