"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions and /v1/chat/completions
(streamed as server-sent events when asked), /v1/models, /health and /metrics, over one
AsyncEngine. Bad input is HTTP 400 with a one-line message in OpenAI's error shape, a
full waiting queue HTTP 429, and a client that goes away has its request cancelled.

    app = make_app(Served(AsyncEngine(engine, max_queue=64), tokenizer, "tiny", 2048))
    uvicorn.run(app, port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxformer.serve.async_engine import AsyncEngine, Overloaded, Stream
from jaxformer.serve.engine import RequestSettings
from jaxformer.serve.prompts import ChatTemplate
from jaxformer.serve.protocol import (ChatRequest, CompletionRequest, RequestError,
                                      chat_logprobs, completion_logprobs)
from jaxformer.serve.text_stream import TextStream

POLL = 0.25  # seconds between checks that a non-streaming client is still there
ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
          "GET /v1/models/{model}, GET /health, GET /metrics")


@dataclasses.dataclass
class Served:
    """What one server serves: the engine, the tokenizer and the model's name and context."""
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_seq_len: int
    end_ids: tuple[int, ...] = ()               # ids that end a request (end-of-text)
    chat: ChatTemplate | None = None            # None: /v1/chat/completions is refused
    encode_chat: Callable[[str], list[int]] | None = None  # a rendered chat's ids
    encode_text: Callable[[str], list[int]] | None = None  # a text prompt's (None: tokenizer's)
    no_chat: str = "this model has no chat template; use /v1/completions"
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class Reply:
    """One request being answered: its engine stream and its text as it arrives."""

    def __init__(self, served: Served, stream: Stream, text: TextStream, prompt_tokens: int):
        self.served, self.stream, self.text = served, stream, text
        self.prompt_tokens = prompt_tokens
        self.finish: str | None = None
        self.id = uuid.uuid4().hex[:24]

    async def chunks(self, disconnected=None) -> AsyncIterator[tuple[str, list]]:
        """(text piece, the tokens it carries) per event, until the request ends
        (self.finish); the request is cancelled if the caller stops early."""
        try:
            while self.finish is None:
                events = await self._events(disconnected)
                piece = "".join(self.text.add(e) for e in events)
                ended = "stop" if self.text.stopped else next(
                    (e.finished for e in events if e.finished), None)
                if ended == "error":
                    raise RequestError("the engine failed on this request; see the server's "
                                       "log", 500, kind="server_error")
                if ended is not None:
                    piece += self.text.finish()
                    self.finish = "length" if ended == "length" else "stop"
                yield piece, self.text.new_tokens()
        finally:  # nothing if it has ended; ended at a stop string: counted as "stop"
            self.served.engine.cancel(self.stream, self.finish or "cancelled")

    async def _events(self, disconnected) -> list:
        """The next event (as a list); a RequestError once `disconnected()` says so."""
        q = self.stream.queue
        if q.empty() and disconnected is not None:
            getter = asyncio.ensure_future(q.get())
            try:
                while not (await asyncio.wait({getter}, timeout=POLL))[0]:
                    if await disconnected():
                        raise RequestError("the client went away", 499)
            finally:
                if not getter.done():
                    getter.cancel()
            return [getter.result()]
        return [await q.get()]

    def usage(self) -> dict:
        n = self.text.generated
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}


def _check_model(served: Served, name: str | None) -> None:
    """A RequestError 404 (as OpenAI answers) unless name is the served model's (or None)."""
    if name is not None and name != served.model_name:
        raise RequestError(f"model {name!r} is not served here; this server serves "
                           f"{served.model_name!r} (GET /v1/models)", 404, param="model",
                           code="model_not_found")


async def _start(served: Served, ids: list[int], settings: dict, stops,
                 names: dict[str, str]) -> Reply:
    """Submit a request; its Reply, or RequestError 400 (the engine's one-line ValueError,
    its settings named as the request's fields: names), 429 (the queue is full) or 503
    (a step of the engine failed: GET /health says so)."""
    if served.engine.failure:
        raise RequestError(f"the engine failed ({served.engine.failure}); restart the server",
                           503, kind="server_error")
    try:
        stream = await served.engine.submit(ids, RequestSettings(**settings))
    except ValueError as e:
        message, param = str(e).splitlines()[0] if str(e) else type(e).__name__, None
        for setting, field in names.items():
            if message.startswith(f"settings.{setting}="):
                message, param = field + message[len(f"settings.{setting}"):], field
        raise RequestError(message, param=param) from None
    except Overloaded as e:
        raise RequestError(str(e), 429, kind="rate_limit_error",
                           code="rate_limit_exceeded") from None
    text = TextStream(served.tokenizer, stops, skip_ids=served.end_ids)
    return Reply(served, stream, text, len(ids))


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`."""
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _envelope(served: Served, reply: Reply, kind: str, choices: list, **more) -> dict:
    return {"id": ("cmpl-" if kind == "text_completion" else "chatcmpl-") + reply.id,
            "object": kind,
            "created": int(time.time()), "model": served.model_name, "choices": choices,
            **more}


async def completion(served: Served, body: CompletionRequest, request: Request):
    """POST /v1/completions: the reply as one JSON, or as server-sent events."""
    body.refuse_unsupported()
    _check_model(served, body.model)
    prompt = body.prompt_one()
    encode = served.encode_text or served.tokenizer.encode
    ids = [int(i) for i in encode(prompt)] if isinstance(prompt, str) else list(prompt)
    top = body.logprobs
    reply = await _start(served, ids, body.settings(served.end_ids, body.max_tokens, top or 0),
                         body.stops(), body.field_names())

    def logprobs(tokens):
        return None if top is None else completion_logprobs(tokens, served.tokenizer.decode)
    if body.stream:
        async def chunks():
            async for piece, tokens in reply.chunks():
                if piece or tokens or reply.finish:
                    yield _envelope(served, reply, "text_completion", [{
                        "index": 0, "text": piece, "logprobs": logprobs(tokens),
                        "finish_reason": reply.finish}])
            if body.include_usage():
                yield _envelope(served, reply, "text_completion", [], usage=reply.usage())
        return _sse(chunks())
    text, tokens = "", []
    async for piece, new in reply.chunks(request.is_disconnected):
        text, tokens = text + piece, tokens + new
    return _envelope(served, reply, "text_completion", [{
        "index": 0, "text": text, "logprobs": logprobs(tokens),
        "finish_reason": reply.finish}], usage=reply.usage())


async def chat_completion(served: Served, body: ChatRequest, request: Request):
    """POST /v1/chat/completions: the folder's chat template renders the messages."""
    body.refuse_unsupported()
    _check_model(served, body.model)
    if served.chat is None:
        raise RequestError(served.no_chat, param="messages")
    try:
        ids = served.encode_chat(served.chat.render(body.plain_messages()))
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    limit = max(served.max_seq_len - len(ids), 1) if limit is None else limit
    top = body.top_logprobs or 0
    reply = await _start(served, ids, body.settings(served.end_ids, limit, top), body.stops(),
                         body.field_names())

    def logprobs(tokens):
        return chat_logprobs(tokens, served.tokenizer.decode) if body.logprobs else None
    if body.stream:
        async def chunks():
            yield _envelope(served, reply, "chat.completion.chunk", [{
                "index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}])
            async for piece, tokens in reply.chunks():
                if piece or tokens or reply.finish:
                    yield _envelope(served, reply, "chat.completion.chunk", [{
                        "index": 0, "delta": {"content": piece} if piece else {},
                        "logprobs": logprobs(tokens), "finish_reason": reply.finish}])
            if body.include_usage():
                yield _envelope(served, reply, "chat.completion.chunk", [],
                                usage=reply.usage())
        return _sse(chunks())
    text, tokens = "", []
    async for piece, new in reply.chunks(request.is_disconnected):
        text, tokens = text + piece, tokens + new
    return _envelope(served, reply, "chat.completion", [{
        "index": 0, "message": {"role": "assistant", "content": text},
        "logprobs": logprobs(tokens), "finish_reason": reply.finish}], usage=reply.usage())


def metrics(served: Served) -> dict:
    """GET /metrics: requests served, held and refused, pages, tokens/s, TTFT and ITL."""
    m, s, now = served.engine.metrics, served.engine.stats, time.monotonic()
    return {"requests": {"served": m.finished["stop"] + m.finished["length"],
                         "cancelled": m.finished["cancelled"], "failed": m.finished["error"],
                         "refused": m.refused, "held": served.engine.active,
                         "running": s.get("running"), "waiting": s.get("waiting")},
            "slots": s.get("slots"),
            "pages": {"total": s.get("pages_total"), "free": s.get("pages_free"),
                      "cached": s.get("pages_cached")},
            "tokens": {"total": m.tokens, "per_second": m.tokens_per_second(now)},
            "time_to_first_token_ms": m.percentiles(m.ttft),
            "inter_token_latency_ms": m.percentiles(m.itl)}


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse: 400 with its first problem in one line (a field that
    takes several forms named with all of them, not with the last one tried)."""
    errors = exc.errors() or [{}]
    first, loc = errors[0], tuple(errors[0].get("loc", ()))[1:]
    if first.get("type") == "json_invalid":
        return _error(RequestError("the body is not JSON; send a JSON object", param="body"))
    if not loc or not isinstance(exc.body, dict):
        return _error(RequestError("the body is not a JSON object; send one, with the header "
                                   "Content-Type: application/json", param="body"))
    field = str(loc[0])
    model = ChatRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
    forms = getattr(model.model_fields.get(field), "annotation", None)
    if sum(tuple(e.get("loc", ()))[1:2] == loc[:1] for e in errors) > 1 and forms is not None:
        value = repr(exc.body.get(field))
        value = value if len(value) <= 60 else value[:57] + "..."
        return _error(RequestError(f"{field}={value} is none of the forms it takes: "
                                   f"{_forms(forms)}", param=field))
    where = ".".join(str(p) for p in loc)
    return _error(RequestError(f"{where}: {first.get('msg', 'invalid')}", param=field))


def _forms(annotation) -> str:
    """A field's type as its JSON reads: str | list[int] | None -> string, list of int."""
    words = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
             "dict": "object", "Any": "anything"}
    text = str(annotation).replace("typing.", "")
    for name, word in words.items():
        text = text.replace(f"[{name}]", f" of {word}").replace(name, word)
    return ", ".join(p.strip() for p in text.split("|") if p.strip() != "None")


def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A route that does not exist or does not take the method: OpenAI's error shape."""
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}; the routes: " + ROUTES
    return _error(RequestError(message, exc.status_code, kind=kind))


def _crash(request: Request, exc: Exception) -> JSONResponse:
    """A failure of the server's own (its traceback goes to the log): 500, one line."""
    first = (str(exc).splitlines() or [""])[0]
    return _error(RequestError(f"the server failed on {request.method} {request.url.path} "
                               f"({type(exc).__name__}: {first:.200}); see the server's log",
                               500, kind="server_error"))


def make_app(served: Served) -> FastAPI:
    """The FastAPI app of one Served model; its engine's thread runs while the app does."""
    @contextlib.asynccontextmanager
    async def lifespan(_):
        served.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            served.engine.stop()

    app = FastAPI(title="jaxformer", lifespan=lifespan)
    app.add_exception_handler(RequestError, lambda _, e: _error(e))
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _crash)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion(served, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await chat_completion(served, body, request)

    def card() -> dict:
        return {"id": served.model_name, "object": "model", "created": served.created,
                "owned_by": "jaxformer", "max_model_len": served.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model(served, name)
        return card()

    @app.get("/health")
    async def health():
        if served.engine.failure:  # 503: a supervisor restarts the server
            return JSONResponse({"status": "failed", "error": served.engine.failure}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return metrics(served)
    return app
