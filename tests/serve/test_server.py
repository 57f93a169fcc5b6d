"""The OpenAI-compatible server (python -m jaxformer.serve: jaxformer.serve.server, its
engine thread jaxformer.serve.async_engine, the request shapes jaxformer.serve.protocol,
chat templates jaxformer.serve.prompts, text and stop strings jaxformer.serve.text_stream),
started once as a real process on a tiny random model saved as a Hugging Face folder and
driven by the `openai` client. References: jaxformer's generate (greedy tokens), a float64
log-softmax of the model's forward (log-probs), transformers' apply_chat_template."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from jaxformer.data.tokenizer import ByteTokenizer, train_bpe
from tests.conftest import NEAR_TIE

pytestmark = pytest.mark.heavy  # run first: tests/conftest.py

REPO = pathlib.Path(__file__).resolve().parents[2]
SLOTS, MAX_QUEUE = 30, 2      # 32 requests held at most
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
# the shared model's weights: each worker's own draw, shown in every test's report (the
# model is made once, under the first test's seed); JAXFORMER_MODEL_SEED=<seed> repeats it
MODEL_SEED = int(os.environ.get("JAXFORMER_MODEL_SEED") or secrets.randbits(32))


@pytest.fixture(autouse=True)
def _model_seed():
    print(f"JAXFORMER_MODEL_SEED={MODEL_SEED}")  # pytest shows it when the test fails


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama-like model saved as a Hugging Face folder with a BPE tokenizer
    and a chat template: (path, model, params, tokenizer)."""
    from jaxformer.convert import to_hf
    from jaxformer.hf import from_hf
    from jaxformer import ModelConfig
    from jaxformer.model.build import param_shapes
    from jaxformer.model.transformer import Transformer

    draw = np.random.default_rng(MODEL_SEED)
    path = tmp_path_factory.mktemp("tiny_hf")
    tok = train_bpe(iter([TEXT] * 20), 300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False,
                      tie_embeddings=False, max_seq_len=128)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: ((p[-1].key == "scale") + draw.normal(0, 0.3, x.shape)).astype(x.dtype),
        param_shapes(cfg))
    to_hf(cfg, params, path)
    tok.save(path)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"}))
    cfg, params = from_hf(path)
    return path, Transformer(cfg), params, tok


@pytest.fixture(scope="module")
def server(folder):
    """The base URL of `python -m jaxformer.serve FOLDER`, running until the module ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = folder[0] / "server.log"  # a file: a pipe nobody reads would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxformer.serve", str(folder[0]), "--port", str(port),
         "--slots", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--page-size", "8",
         "--model-name", "tiny"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start in 600 s"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy(folder, prompts: list[list[int]], n: int) -> list[list[int]]:
    """jaxformer's generate, greedy, the prompts in one batch: each one's first n new
    tokens (its end-of-text dropped). One shape (32 rows of 64, 24 new tokens) for every
    call: compiled once."""
    from jaxformer.decode.loops import generate
    _, model, params, tok = folder
    assert len(prompts) <= 32 and max(map(len, prompts)) <= 64 and n <= 24
    padded = np.zeros((32, 64), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts] + [1] * (32 - len(prompts)))
    out = generate(model, params, padded, prompt_lengths=lengths, max_new_tokens=24,
                   rng=jax.random.key(0), temperature=0.0, eos_id=tok.eot_id)
    rows = [np.asarray(out.tokens)[i, :min(int(out.lengths[i]), n)].tolist()
            for i in range(len(prompts))]
    return [[t for t in r if t != tok.eot_id] for r in rows]


@functools.cache
def forward(model):
    """The model's logits, jitted: one program for every row of 128 tokens."""
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


def log_softmax64(folder, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float64 log-softmax of the model's logits at each position (the
    row padded after them to 128 tokens: a causal model's logits before are the same)."""
    _, model, params, _ = folder
    row = np.zeros((1, 128), np.int32)
    row[0, :len(ids)] = ids
    logits = np.asarray(forward(model)(params, row)[0, :len(ids)], np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def decided(folder, prompt: list[int], new: list[int], n: int) -> bool:
    """Whether greedy chose each of new's tokens (and its end, where it ended before n) by
    at least NEAR_TIE (tests/conftest.py) over the runner-up in the float64 log-softmax.
    Two right answers differ at a near tie, which float32's rounding in another batch or
    cache layout (the server's pages) may break the other way: a random prompt's 24 greedy
    steps hold one within 1e-3 about one time in 25 here, so one within 1e-5 about one in 2,500."""
    steps = min(len(new) + 1, n)
    lp = np.sort(log_softmax64(folder, prompt + new)[len(prompt) - 1:][:steps], axis=-1)
    return bool(np.all(lp[:, -1] - lp[:, -2] >= NEAR_TIE))


def decided_prompts(folder, draw, count: int, n: int, ok=lambda new: True):
    """count prompts from draw() whose n greedy tokens pass ok and are decided: (prompts,
    their tokens); a prompt near a tie is drawn again."""
    prompts, news = [], []
    for _ in range(20):
        batch = [draw() for _ in range(count - len(prompts))]
        for prompt, new in zip(batch, greedy(folder, batch, n)):
            if ok(new) and decided(folder, prompt, new, n):
                prompts.append(prompt)
                news.append(new)
        if len(prompts) == count:
            return prompts, news
    pytest.fail(f"{count - len(prompts)} of {count} prompts not found in 20 draws")


def random_prompt(folder, n: int) -> list[int]:
    tok = folder[3]
    return [int(i) for i in rng.integers(1, tok.vocab_size, n)]


rng = np.random.default_rng()  # rebound to each test's by tests/conftest.py


def test_models_health_and_metrics(server, client):
    """/v1/models lists the served name with its context, /health answers, /metrics counts."""
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"] == 128
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    m = httpx.get(server + "/metrics").json()
    assert m["slots"] == SLOTS and m["pages"]["free"] <= m["pages"]["total"]
    assert set(m["time_to_first_token_ms"]) == {"p50", "p90", "p99"}


def test_completion_is_greedy_generate_with_its_logprobs(folder, client):
    """A greedy completion (prompt as text, then as token ids) is generate's tokens as
    text; its log-probs, top alternatives and text offsets are the float64 forward's."""
    tok = folder[3]
    # a prompt whose completion is not empty (a random model may end at once: 1 in ~300)
    texts = iter([TEXT[:int(n)] for n in rng.permutation(np.arange(5, 37))])
    [ids], [want] = decided_prompts(folder, lambda: tok.encode(next(texts)).tolist(), 1, 12,
                                    ok=bool)
    text = tok.decode(ids)
    ref = log_softmax64(folder, ids + want)[len(ids) - 1:-1]  # [new, vocab]
    for prompt in (text, ids):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                      temperature=0, logprobs=3)
        c = r.choices[0]
        assert c.text == tok.decode(want), (c.text, tok.decode(want))
        assert r.usage.prompt_tokens == len(ids)
        lp = c.logprobs
        assert lp.tokens == [tok.decode([t]) for t in want]
        np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(want)), want],
                                   atol=1e-5)
        for got, row in zip(lp.top_logprobs, ref):
            want_top = {}
            for i in np.argsort(-row)[:3]:  # by text, the likelier of two that read the same
                want_top.setdefault(tok.decode([i]), row[i])
            assert got.keys() == want_top.keys()
            np.testing.assert_allclose([got[k] for k in want_top], list(want_top.values()),
                                       atol=1e-5)
        for i, offset in enumerate(lp.text_offset):  # where the token's text starts
            before = tok.decode(want[:i])
            if not before.endswith("\ufffd"):  # (one inside a character: where it starts)
                assert offset == len(before), (i, lp.text_offset)


def test_chat_renders_the_folders_template(folder, client):
    """A chat completion continues the prompt transformers' apply_chat_template renders
    with the folder's template (its special tokens read as their ids); its log-probs come
    in the chat shape."""
    from transformers import PreTrainedTokenizerFast
    path, _, _, tok = folder
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                 eos_token="<|endoftext|>")
    chats = {}

    def draw():
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": TEXT[:int(rng.integers(3, 30))]}]
        text = hf.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        chats[tuple(ids)] = messages
        return ids
    [ids], [want] = decided_prompts(folder, draw, 1, 10)
    messages = chats[tuple(ids)]
    assert ids.count(tok.eot_id) == 2  # the template's end-of-text read as its id
    ref = log_softmax64(folder, ids + want)[len(ids) - 1:-1]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == tok.decode(want)
    assert r.usage.prompt_tokens == len(ids)
    content = c.logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in want]
    np.testing.assert_allclose([e.logprob for e in content], ref[np.arange(len(want)), want],
                               atol=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in content)


def test_streaming_gives_the_same_text(folder, client):
    """Streamed completions and chats (server-sent events) add up to the whole reply, one
    event per token (min_tokens holds the model's end-of-text back: a random model may
    end at once)."""
    ids = random_prompt(folder, int(rng.integers(3, 20)))
    ask = dict(model="tiny", prompt=ids, max_tokens=16, temperature=0,
               extra_body={"min_tokens": 4})
    whole = client.completions.create(**ask).choices[0]
    stream = list(client.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True}))
    chunks = [c.choices[0] for c in stream[:-1]]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == whole.finish_reason and len(chunks) >= 4
    assert stream[-1].usage.prompt_tokens == len(ids) and stream[-1].choices == []
    messages = [{"role": "user", "content": "jumps over"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           temperature=0).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)]
    assert "".join(parts) == whole


def test_stop_strings_cut_the_text(folder, client):
    """A stop string ends the request: the text is cut before it, streamed or not."""
    tok = folder[3]
    [ids], [new] = decided_prompts(  # a greedy text long enough to pick a stop from
        folder, lambda: random_prompt(folder, 6), 1, 24, ok=lambda new: len(tok.decode(new)) >= 8)
    full = tok.decode(new)
    at = int(rng.integers(1, len(full) - 3))
    stop = full[at:at + 3]
    want = full[:full.index(stop)]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0,
                                  stop=[stop, "never seen \u2603"], logprobs=1)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    lp = r.choices[0].logprobs  # greedy's first tokens, those that start before the cut
    n = len(lp.tokens)
    assert lp.tokens == [tok.decode([t]) for t in new[:n]]
    assert (n == 0) == (want == "")
    if n and len(full) == sum(len(tok.decode([t])) for t in new):  # no character split
        assert len(tok.decode(new[:n - 1])) < len(want) <= len(tok.decode(new[:n])), n
    streamed = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=stop, stream=True,
        logprobs=1)]
    assert "".join(c.text for c in streamed) == want
    assert streamed[-1].finish_reason == "stop"
    for field in ("tokens", "token_logprobs", "text_offset"):  # streamed as they were sent
        assert sum((getattr(c.logprobs, field) for c in streamed), []) == getattr(lp, field)


def test_32_concurrent_streaming_clients(folder, server):
    """32 streaming clients at once each get the tokens greedy generate gives their prompt."""
    tok = folder[3]
    prompts, news = decided_prompts(
        folder, lambda: random_prompt(folder, int(rng.integers(1, 24))), 32, 10)
    want = [tok.decode(t) for t in news]

    async def one(c, prompt):
        s = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                       temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in s])

    async def run():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0,
                               timeout=60)
        return await asyncio.wait_for(asyncio.gather(*[one(c, p) for p in prompts]), 60)
    before = httpx.get(server + "/metrics").json()
    assert asyncio.run(run()) == want
    after = httpx.get(server + "/metrics").json()
    assert after["requests"]["served"] - before["requests"]["served"] == 32
    assert after["tokens"]["total"] - before["tokens"]["total"] >= 32
    assert after["time_to_first_token_ms"]["p50"] > 0 and after["inter_token_latency_ms"]["p99"]


def test_a_seed_repeats_a_sampled_completion(folder, client):
    """A sampled request with a seed gives the same text again; another seed another."""
    def sample(seed):
        return client.completions.create(model="tiny", prompt="The quick", max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"min_tokens": 16, "top_k": 50}
                                         ).choices[0].text
    seed = int(rng.integers(2**31))
    first = sample(seed)
    assert sample(seed) == first and sample(seed + 1) != first


def error_of(server, route: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(server + route, json=body, timeout=30)
    return r.status_code, r.json()


@pytest.mark.parametrize("change, words", [
    (dict(prompt=list(range(1, 200))), "max_seq_len"),       # longer than the context
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=2), "n=2"),
    (dict(prompt=None), "prompt"),
    (dict(prompt=[1, "a"]), "prompt=[1, 'a'] is none of the forms it takes: string, list of "
                            "integer"),
    (dict(logprobs=21), "logprobs=21"),
    (dict(max_tokens=0), "max_tokens=0"),
])
def test_bad_requests_get_400_in_one_line(server, change, words):
    """Bad input is HTTP 400, OpenAI's error shape, one line naming the problem."""
    body = {"model": "tiny", "prompt": "the", "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, answer = error_of(server, "/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "\n" not in error["message"] and words in error["message"], error


@pytest.mark.parametrize("change, words, param", [
    (dict(max_completion_tokens=0), "max_completion_tokens=0", "max_completion_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs=21", "top_logprobs"),
    (dict(messages=[{"role": "user", "content": ["hi"]}]), "messages[0].content[0] is str",
     "messages"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools are not", "tools"),
    (dict(response_format={"type": "json_object"}), "'json_object' is not", "response_format"),
])
def test_bad_chat_requests_get_400_naming_the_requests_field(server, change, words, param):
    """A chat's bad input is 400 in one line naming the field the request gave (not the
    engine's name for it), and what would change the reply's kind is refused, not dropped."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the"}],
            "max_tokens": 4, **change}
    status, answer = error_of(server, "/v1/chat/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert "\n" not in error["message"] and words in error["message"], error
    assert error["param"] == param, error


def test_what_no_route_answers_is_openais_error_shape(server, client):
    """An unknown model is 404 model_not_found (the openai client's NotFoundError), as is
    an unknown route; a route asked with another method 405; a body sent without its JSON
    content type 400 saying so; explicit nulls are the defaults."""
    assert client.models.retrieve("tiny").id == "tiny"
    for ask in (lambda: client.models.retrieve("gpt-17"),
                lambda: client.completions.create(model="gpt-17", prompt="a", max_tokens=1)):
        with pytest.raises(openai.NotFoundError) as e:
            ask()
        assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]
    for method, route, status, words in (("GET", "/nope", 404, "GET /nope: Not Found"),
                                         ("GET", "/v1/completions", 405, "Method Not Allowed")):
        r = httpx.request(method, server + route, timeout=30)
        error = r.json()["error"]
        assert r.status_code == status and words in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}
    r = httpx.post(server + "/v1/completions", content=json.dumps({"prompt": "a"}), timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"][
        "message"]
    status, answer = error_of(server, "/v1/completions", {
        "prompt": "a", "max_tokens": 1, "stream": None, "echo": None})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_failure_of_the_servers_own_is_500_in_one_line():
    """An exception the server did not expect (here its tokenizer's) is 500 in OpenAI's
    error shape, naming it, not a bare text page."""
    from fastapi.testclient import TestClient
    from jaxformer.serve.server import Served, make_app

    class Broken(ByteTokenizer):
        def encode(self, text):
            raise KeyError("no such piece")
    app = make_app(Served(None, Broken(), "m", 64))
    r = TestClient(app, raise_server_exceptions=False).post(
        "/v1/completions", json={"model": "m", "prompt": "hi"})
    error = r.json()["error"]
    assert r.status_code == 500 and error["type"] == "server_error", error
    assert "KeyError" in error["message"] and "\n" not in error["message"]


def test_chat_without_a_template_or_refused_by_it_is_400():
    """Without a template, /v1/chat/completions is 400 in one line; so is a template's own
    refusal (raise_exception) and a message part other than text (no engine touched)."""
    from fastapi.testclient import TestClient
    from jaxformer.serve.prompts import ChatTemplate
    from jaxformer.serve.server import Served, make_app

    def answer(chat, content="hi"):
        app = make_app(Served(None, ByteTokenizer(), "m", 64, chat=chat, encode_chat=list,
                              no_chat="m has no chat template"))
        r = TestClient(app).post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": content}]})
        return r.status_code, r.json()["error"]["message"]
    assert answer(None) == (400, "m has no chat template")
    refusing = ChatTemplate("{{ raise_exception('one user message, please') }}")
    assert answer(refusing) == (400, "the chat template refused the messages: one user "
                                     "message, please")
    status, message = answer(refusing, [{"type": "image_url", "image_url": {"url": "x"}}])
    assert status == 400 and "image_url" in message and "\n" not in message


def test_an_overloaded_queue_answers_429_within_a_second(folder, server):
    """With 30 slots and --max-queue 2, 40 requests at once: the 8 past 32 are answered
    429 within a second; the others complete. Requests the engine refused (400) before
    hold no place."""
    for _ in range(3):
        assert error_of(server, "/v1/completions", {"prompt": "a", "top_p": 0.0})[0] == 400
    async def one(c, prompt):
        start = time.monotonic()
        r = await c.post(server + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 64, "min_tokens": 64,
            "temperature": 0})
        return r.status_code, time.monotonic() - start

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[one(c, random_prompt(folder, 4)) for _ in range(40)])
    answers = asyncio.run(run())
    refused = [t for status, t in answers if status == 429]
    assert len(refused) == 40 - SLOTS - MAX_QUEUE, answers
    assert max(refused) < 1.0, refused
    assert sorted({s for s, _ in answers}) == [200, 429]


def test_a_disconnecting_client_frees_its_slot(folder, server):
    """A streaming client that goes away mid-reply has its request cancelled: /metrics
    shows nothing running and every page free again."""
    before = httpx.get(server + "/metrics").json()
    body = {"model": "tiny", "prompt": random_prompt(folder, 5), "max_tokens": 120,
            "min_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    deadline = time.monotonic() + 10
    while True:
        m = httpx.get(server + "/metrics").json()
        if m["requests"]["cancelled"] > before["requests"]["cancelled"] and \
                m["requests"]["held"] == 0 and m["requests"]["running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["pages"]["free"] + (m["pages"]["cached"] or 0) == m["pages"]["total"], m


def test_text_stream_waits_for_whole_characters_and_holds_back_stops():
    """Bytes of one character are sent together; text that may start a stop string waits."""
    from jaxformer.serve.text_stream import TextStream

    class E:
        def __init__(self, token):
            self.token, self.logprob, self.top, self.finished = token, 0.0, (), None
    text = TextStream(ByteTokenizer(), stop=("ab!",))
    pieces = [text.add(E(b)) for b in "xé aab".encode()]
    assert pieces == ["", "", "", "x", "é", " ", "a"]
    assert text.finish() == "ab" and not text.stopped
    text = TextStream(ByteTokenizer(), stop=("ab",))
    out = "".join(text.add(E(b)) for b in b"xyzabc")
    assert (out + text.finish(), text.stopped) == ("xyz", True)


def test_text_stream_pairs_each_piece_with_its_own_tokens(rng):
    """Random text of 1- to 4-byte characters, one byte a token, a stop string cut at a
    random character: every token's offset is its character's index in the text, the
    tokens kept are the bytes of the text before the stop, and each streamed piece
    comes with exactly its own bytes' tokens (for their log-probs)."""
    from jaxformer.serve.text_stream import TextStream

    class E:
        def __init__(self, token):
            self.token, self.logprob, self.top, self.finished = token, 0.0, (), None
    chars = ["a", "b", " ", "é", "ß", "€", "中", "😀", "𝄞"]
    text = "".join(rng.choice(chars, 40))
    cut = int(rng.integers(5, 35))
    stop = "#" + text[cut:cut + 2]
    full = text[:cut] + stop + text[cut:]  # the first stop string is at `cut`
    stream = TextStream(ByteTokenizer(), stop=(stop,))
    sent = []
    for b in full.encode():
        piece = stream.add(E(b))
        sent.append((piece, bytes(t.token for t in stream.new_tokens())))
    piece = stream.finish()
    sent.append((piece, bytes(t.token for t in stream.new_tokens())))
    assert stream.stopped and "".join(p for p, _ in sent) == text[:cut]
    for piece, carried in sent:
        assert carried == piece.encode(), (piece, carried)
    offsets = [i for i, c in enumerate(full) for _ in c.encode()]
    assert [t.offset for t in stream.tokens] == offsets[:len(stream.tokens)]
    assert bytes(t.token for t in stream.kept_tokens()) == text[:cut].encode()


def test_a_text_prompt_is_encoded_as_transformers_encodes_it(rng):
    """A completion's text prompt is transformers' tokenizer(text) ids: the BOS its
    tokenizer.json's post-processor adds, and special tokens written in it read as theirs
    (a chat, rendered by its template, adds none); the server submits those ids."""
    from fastapi.testclient import TestClient
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from jaxformer.serve.prompts import special_token_encoder
    from jaxformer.serve.server import Served, make_app

    tok = train_bpe(iter([TEXT] * 5), 280)
    tok.hf.add_special_tokens(["<s>"])
    bos = tok.hf.token_to_id("<s>")
    tok.hf.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                          special_tokens=[("<s>", bos)])
    words = TEXT.split()
    text = " ".join(rng.choice(words, 6)) + "<|endoftext|>" + " ".join(rng.choice(words, 3))
    want = PreTrainedTokenizerFast(tokenizer_object=tok.hf)(text)["input_ids"]
    assert want[0] == bos and tok.eot_id in want
    assert special_token_encoder(tok, add_special_tokens=True)(text) == want
    assert special_token_encoder(tok)(text) == want[1:]

    class Engine:  # what the server submits, then a refusal
        failure = None

        async def submit(self, ids, settings):
            self.ids = ids
            raise ValueError("seen")
    served = Served(Engine(), tok, "m", 64, encode_text=special_token_encoder(tok, True))
    r = TestClient(make_app(served)).post("/v1/completions", json={"prompt": text})
    assert r.status_code == 400 and served.engine.ids == want


def test_metrics_count_a_stop_string_as_served_and_keep_one_window_of_tokens():
    """A request the server ends at its stop string counts as served, one whose client
    went away as cancelled; the tokens/s window holds its last WINDOW seconds alone."""
    from jaxformer.serve.async_engine import AsyncEngine, Metrics, Stream
    from jaxformer.serve.engine import Event

    engine = AsyncEngine(type("E", (), {"stats": lambda self: {"slots": 2}})(), max_queue=2)
    ends = {}
    for reason in ("stop", "cancelled"):
        stream = Stream(asyncio.Queue(), 0.0, request_id=len(ends))
        engine.cancel(stream, reason)
        engine._deliver([(stream, Event(stream.request_id, -1, 0.0, (), "cancelled"))])
        ends[reason] = dict(engine.metrics.finished)
    assert ends == {"stop": {"stop": 1}, "cancelled": {"stop": 1, "cancelled": 1}}
    m = Metrics()
    stream = Stream(asyncio.Queue(), 0.0)
    for i in range(2000):  # 100 tokens a second for 20 s
        m.token(stream, i / 100)
    assert len(m.recent) == 100 * m.WINDOW + 1 and m.tokens == 2000
    assert m.tokens_per_second(19.99) == pytest.approx(100, rel=0.01)


def test_a_port_outside_0_to_65535_is_refused_in_one_line(capsys):
    from jaxformer.serve.__main__ import parse
    for bad in ("99999", "-1", "http"):
        with pytest.raises(SystemExit):
            parse(["run", "--port", bad])
        assert f"{bad!r} is not a TCP port; pass 0 to 65535" in capsys.readouterr().err
    assert parse(["run", "--port", "0"]).port == 0


def test_matmul_precision_replaces_the_models_and_is_warned_of_where_rows_meet(folder, capsys):
    """--matmul-precision's model (None: the folder's own), and a warning at start where the
    entry's scales span the batch (the table's batch_invariant false: fp8)."""
    from jaxformer.serve.__main__ import load, parse
    assert parse(["run", "--matmul-precision", "fp8"]).matmul_precision == "fp8"
    for precision, warned in [(None, False), ("fp8", True), ("fp8_rowwise", False)]:
        model, _, _ = load(str(folder[0]), False, precision)
        assert model.cfg.matmul_precision == (precision or "default")
        err = capsys.readouterr().err
        assert ("warning: model.matmul_precision=fp8 scales each matmul over the whole batch"
                in err) == warned, err


def test_a_failed_engine_step_ends_its_requests_and_makes_the_server_unhealthy():
    """An engine step that raises (a device out of memory, say, after the pool was handed
    to the step) ends the requests it held with 500; /health is then 503 naming the
    failure, and later requests 503 at once rather than failing one by one."""
    from fastapi.testclient import TestClient
    from jaxformer.serve.async_engine import AsyncEngine
    from jaxformer.serve.server import Served, make_app

    class Failing:  # accepts requests; its first step fails
        def __init__(self):
            self.ids, self.cancelled = [], []

        def stats(self):
            return {"slots": 2}

        def submit(self, prompt, settings):
            self.ids.append(len(self.ids))
            return self.ids[-1]

        def has_work(self):
            return len(self.cancelled) < len(self.ids)

        def step(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nwhile running")

        def cancel(self, request_id):
            self.cancelled.append(request_id)
    engine = AsyncEngine(Failing(), max_queue=2)
    with TestClient(make_app(Served(engine, ByteTokenizer(), "m", 64))) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and health.json() == {
            "status": "failed", "error": "RuntimeError: RESOURCE_EXHAUSTED: out of memory"}
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"]
    assert engine.engine.cancelled == [0]
