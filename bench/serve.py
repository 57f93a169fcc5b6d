"""Serving under load: python -m jaxformer.serve against a static-batch generate and
transformers' continuous batching, on the same random model and the same workload.

    python bench/serve.py [--clients 1,8,32 --requests 96 --prompt 16,256 --output 16,128
        --lengths uniform --rate 0 --seed 0 --rounds 1 --d-model 256 --layers 4
        --systems serve,static,hf --cache-dtype int8]

The model: a random Llama-shaped decoder (RMSNorm, SwiGLU, RoPE, GQA 8 heads over 2, an
untied head; d_model 256 x 4 layers, vocab 2048, max_seq_len 512, float32 by default)
written as a Hugging Face folder (jaxformer.convert.to_hf) with a byte-level BPE
tokenizer, so all three systems read the same weights. The workload (seeded): each
request's prompt length uniform in --prompt and its output length drawn by --lengths
within --output (OUTPUTS: uniform, or lognormal: a long tail as chat logs have, median
LOGNORMAL[0] tokens, sigma LOGNORMAL[1], clipped to --output); random token ids; every
request runs to its output length (min_tokens = max_tokens, no end-of-text); --clients
clients in a closed loop (each sends its next request when its last
is answered), or with --rate R > 0 Poisson arrivals at R requests/s with at most --clients
in flight.

- serve: `python -m jaxformer.serve FOLDER --slots C` as a subprocess, driven by C
  streaming clients over HTTP (httpx, server-sent events, /v1/completions with the prompt
  as token ids); time to first token (TTFT) and inter-token latency (ITL) as the client sees
  the chunks arrive.
- static: jaxformer.decode.generate in batches of C requests in arrival order, each batch
  to its longest output (its prompts right-padded to the longest prompt); a batch starts
  when its last request has arrived and the previous batch is done (batch times measured
  on a compiled generate, the compile not counted); a request's tokens arrive together
  when its batch ends, so its TTFT is that wait and its ITL is the batch's seconds per step.
- hf: transformers' ContinuousBatchingManager in this process on the CPU (sdpa, which it
  runs over its paged cache; max_batch_tokens its default), requests added as they
  arrive, TTFT and ITL from its token timestamps.

--rounds R draws R workloads (seeds --seed, --seed + 1, ...) and runs each through every
system in turn, the server started and warmed once for all of them (a later round's prompts
are fresh: no prefix of them is cached): the machine's drift then falls on every system
alike, and each round's ratio to the static batch is printed with their median.

Prints one table (output tokens/s, requests/s; TTFT and ITL p50/p90/p99 in ms; a row per
system and round), the ratios and the CPU; --profile adds the engine alone in this process
(engine_profile); asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PAGE = 16  # tokens per KV-cache page (the server's default)

from serve_workload import (OUTPUTS, Job, Timing, ratios, summary, table,  # noqa: E402
                            warm_up, workload)


def model_folder(a, folder: pathlib.Path) -> pathlib.Path:
    """The random Llama-shaped model (module docstring) as a Hugging Face folder."""
    import jax
    from jaxformer import ModelConfig
    from jaxformer.convert import to_hf
    from jaxformer.data.tokenizer import train_bpe
    from jaxformer.model.build import param_shapes

    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=8,
                      n_kv_heads=2, norm="rmsnorm", ffn="swiglu", use_bias=False,
                      tie_embeddings=False, max_seq_len=a.max_seq_len, position="rope")
    draw = np.random.default_rng(a.seed)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: ((p[-1].key == "scale") + draw.normal(0, 0.05, x.shape)).astype(x.dtype),
        param_shapes(cfg))
    to_hf(cfg, params, folder, config_overrides={"eos_token_id": 0, "bos_token_id": 0})
    words = [" ".join(str(i * j) for j in range(40)) for i in range(200)]
    train_bpe(iter(words), min(a.vocab, 1024)).save(folder)
    return folder


# ---- serve: the HTTP server, driven by streaming clients -------------------------------

def start_server(folder: pathlib.Path, slots: int, log: pathlib.Path, cache_dtype=None):
    """(the process, its base URL) of python -m jaxformer.serve FOLDER, once /health answers."""
    import httpx
    with socket.socket() as s:
        port = s.bind(("127.0.0.1", 0)) or s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxformer.serve", str(folder), "--port",
                             str(port), "--slots", str(slots), "--max-queue", "4096",
                             "--model-name", "m"]
                            + (["--cache-dtype", cache_dtype] if cache_dtype else []),
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 600 s")


async def one_request(http, url: str, job: Job, t0: float) -> Timing:
    """Send one streaming completion; the client's view of its tokens' arrivals (a chunk
    may carry several tokens, counted by its log-probs' entries; ITL: the gaps between
    chunks, as vLLM's benchmark counts them)."""
    body = {"model": "m", "prompt": list(job.prompt), "max_tokens": job.new,
            "min_tokens": job.new, "temperature": 0.0, "stream": True, "logprobs": 0}
    sent = time.perf_counter()
    stamps, tokens = [], 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            made = len((choices[0].get("logprobs") or {}).get("tokens") or ())
            if made:
                stamps.append(time.perf_counter())
                tokens += made
    return Timing(stamps[0] - sent, list(np.diff(stamps)), tokens, stamps[-1] - t0)


async def drive(url: str, jobs: list[Job], clients: int) -> tuple[list[Timing], float]:
    """Every job through `clients` concurrent streams, each job sent at its arrival."""
    import httpx
    gate = asyncio.Semaphore(clients)
    t0 = time.perf_counter()

    async def run(http, job):
        await asyncio.sleep(max(0.0, job.arrival - (time.perf_counter() - t0)))
        async with gate:
            return await one_request(http, url, job, t0)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        timings = await asyncio.gather(*(run(http, j) for j in jobs))
    return list(timings), time.perf_counter() - t0


@contextlib.contextmanager
def served(folder: pathlib.Path, jobs: list[Job], clients: int, cache_dtype=None):
    """The serve rows: the server started with `clients` slots and warmed (by `jobs`'
    warm_up), then run(jobs) drives it with a round's jobs and gives their row."""
    proc, url = start_server(folder, clients, folder / f"server_{clients}.log", cache_dtype)
    try:
        asyncio.run(drive(url, warm_up(jobs, clients), clients))
        yield lambda jobs: summary("serve (jaxformer)", clients,
                                   *asyncio.run(drive(url, jobs, clients)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def engine_profile(folder: pathlib.Path, jobs: list[Job], clients: int) -> dict:
    """The engine alone in this process (no HTTP), every job submitted at once into
    `clients` slots: its wall seconds split into the compiled programs' (decode steps and
    prompt chunks, each call waited for) and the host's (the rest of Engine.step), after a
    first pass that compiles. What dominates a slow serve row."""
    import jax
    from jaxformer.hf import from_hf
    from jaxformer.model.transformer import Transformer
    from jaxformer.serve.engine import Engine, RequestSettings

    cfg, params = from_hf(folder)
    engine = Engine(Transformer(cfg), params, slots=clients)
    engine.warm()  # as the server does before it listens: no compile timed
    spent = {"decode": [0.0, 0], "prefill": [0.0, 0]}
    program = engine.program

    def timed(params, pool, tokens, *rest):
        t = time.perf_counter()
        pool, out = program(params, pool, tokens, *rest)
        out = jax.block_until_ready(out)
        kind = spent["decode" if tokens.shape[1] == 1 else "prefill"]
        kind[0] += time.perf_counter() - t
        kind[1] += 1
        return pool, out
    engine.program = timed
    for batch in (warm_up(jobs, clients), jobs):
        spent.update(decode=[0.0, 0], prefill=[0.0, 0])
        t0, made = time.perf_counter(), 0
        for j in batch:
            engine.submit(list(j.prompt), RequestSettings(max_tokens=j.new, min_tokens=j.new,
                                                          temperature=0.0))
        while engine.has_work():
            made += len(engine.step())
        wall = time.perf_counter() - t0
    (dec, calls), (pre, chunks) = spent["decode"], spent["prefill"]
    return {"clients": clients, "tokens_per_s": made / wall, "wall_s": wall, "decode_s": dec,
            "decode_calls": calls, "decode_ms_per_call": 1e3 * dec / max(calls, 1),
            "prefill_s": pre, "prefill_calls": chunks, "host_s": wall - dec - pre}


# ---- static: generate in batches of `clients` -------------------------------------------

@contextlib.contextmanager
def static_runs(folder: pathlib.Path, jobs: list[Job], clients: int):
    """The static rows: run(jobs) is static_batches of the model read once."""
    from jaxformer.hf import from_hf
    from jaxformer.model.transformer import Transformer

    cfg, params = from_hf(folder)
    yield functools.partial(static_batches, Transformer(cfg), params, clients=clients)


def static_batches(model, params, jobs: list[Job], clients: int) -> dict:
    """The static row: generate over batches of `clients` jobs in arrival order (module
    docstring); each batch's shape compiled by a first call, the second one timed."""
    import jax
    from jaxformer.decode.loops import generate

    width = max(len(j.prompt) for j in jobs)
    timings, clock = [], 0.0
    for start in range(0, len(jobs), clients):
        batch = jobs[start:start + clients]
        prompts = np.zeros((len(batch), width), np.int32)
        lengths = np.array([len(j.prompt) for j in batch], np.int32)
        for r, j in enumerate(batch):
            prompts[r, :len(j.prompt)] = j.prompt
        new = max(j.new for j in batch)

        def run():
            out = generate(model, params, prompts, prompt_lengths=lengths, max_new_tokens=new,
                           rng=jax.random.key(0), temperature=0.0)
            return jax.block_until_ready(out.tokens)
        run()
        t = time.perf_counter()
        run()
        seconds = time.perf_counter() - t
        begin = max(clock, max(j.arrival for j in batch))
        clock = begin + seconds
        timings += [Timing(clock - j.arrival, [seconds / new] * (j.new - 1), j.new, clock)
                    for j in batch]
    return summary("static generate", clients, timings, clock)


# ---- hf: transformers' continuous batching in this process -------------------------------

@contextlib.contextmanager
def hf_batching(folder: pathlib.Path, jobs: list[Job], clients: int, threads: int):
    """The hf rows: ContinuousBatchingManager, run(jobs) adding them at their arrival with
    at most `clients` in flight, timed by its token timestamps (a first pass over `clients`
    jobs warms it up); its cache sized as the engine's (else it takes 90% of free memory;
    `jobs`: the longest of every round's)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(j.new for j in jobs))
    longest = max(len(j.prompt) + j.new for j in jobs)
    budget = ContinuousBatchingConfig(  # the engine's: 16-token pages, 4 x 128 prompt tokens
        page_size=PAGE, num_blocks=clients * -(-longest // PAGE) + clients,
        max_batch_tokens=4 * 128, max_requests_per_batch=clients)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=budget)
    manager.start()
    try:
        hf_pass(manager, warm_up(jobs, clients), clients)
        yield lambda jobs: summary("transformers CB", clients, *hf_pass(manager, jobs, clients))
    finally:
        manager.stop(block=True)


def hf_pass(manager, jobs: list[Job], clients: int) -> tuple[list[Timing], float]:
    """Every job through the running manager; (their timings, the wall seconds)."""
    t0, pending, sent, timings = time.perf_counter(), list(jobs), {}, []
    while pending or sent:
        now = time.perf_counter() - t0
        while pending and len(sent) < clients and pending[0].arrival <= now:
            job = pending.pop(0)
            rid = manager.add_request(list(job.prompt), max_new_tokens=job.new,
                                      record_timestamps=True, eos_token_id=-1)
            sent[rid] = (job, time.perf_counter())
        out = manager.get_result(timeout=0.01)
        if out is None or not out.is_finished():
            continue
        job, at = sent.pop(out.request_id)
        stamps = out.timestamps or [time.perf_counter()]
        timings.append(Timing(stamps[0] - at, list(np.diff(stamps)),
                              len(out.generated_tokens), stamps[-1] - t0))
    return timings, time.perf_counter() - t0


# ---- the table ------------------------------------------------------------------------

# name: (its runs as a context manager, whether it stays open across rounds: the server
# waits on its queue and the static model is a read file, but transformers' manager keeps a
# thread of its own, so it is opened for each round and closed before the next system runs)
SYSTEMS = {"serve": (lambda a, f, jobs, c: served(f, jobs, c, a.cache_dtype), True),
           "static": (lambda a, f, jobs, c: static_runs(f, jobs, c), True),
           "hf": (lambda a, f, jobs, c: hf_batching(f, jobs, c, a.torch_threads), False)}


def interleaved(a, folder: pathlib.Path, rounds: list[list[Job]], clients: int) -> list[dict]:
    """Every system's rows at `clients`, round by round: each round's jobs through every
    system in turn, so that the machine's drift over the run falls on all of them alike."""
    every = [j for jobs in rounds for j in jobs]
    rows = []
    with contextlib.ExitStack() as held:
        runs = {name: held.enter_context(SYSTEMS[name][0](a, folder, every, clients))
                for name in a.systems if SYSTEMS[name][1]}
        for r, jobs in enumerate(rounds):
            for name in a.systems:
                with contextlib.ExitStack() as own:
                    run = runs.get(name) or own.enter_context(
                        SYSTEMS[name][0](a, folder, every, clients))
                    rows.append(dict(run(jobs), key=name, round=r))
                if rows[-1]["tokens"] != sum(j.new for j in jobs):
                    print(f"({name}: {rows[-1]['tokens']} tokens for "
                          f"{sum(j.new for j in jobs)} asked)")
                print(table(rows[-1:]).splitlines()[1], flush=True)
    return rows


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name")]
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} CPUs"


def parsed(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--clients", type=pair, default=(1, 8, 32))
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prompt", type=pair, default=(16, 256), help="prompt lengths: lo,hi")
    p.add_argument("--output", type=pair, default=(16, 128), help="output lengths: lo,hi")
    p.add_argument("--lengths", choices=sorted(OUTPUTS), default="uniform",
                   help="how output lengths are drawn within --output")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second "
                   "(0: a closed loop of --clients clients)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="rounds of --requests jobs (seeds "
                   "--seed, --seed + 1, ...), each through every system in turn")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--torch-threads", type=int, default=os.cpu_count())
    p.add_argument("--cache-dtype", default=None, help="the server's KV cache pages' format "
                   "(--cache-dtype int8; default the model's float32)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=None, help="also write the rows here as JSON")
    p.add_argument("--profile", action="store_true", help="also the engine alone in this "
                   "process: its time in programs and on the host")
    a = p.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    if set(a.systems) - set(SYSTEMS):
        p.error(f"--systems: pick from {', '.join(SYSTEMS)}")
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: run at least 1")
    return a


def main(argv=None) -> list[dict]:
    a = parsed(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(a, pathlib.Path(tmp) / "model")
        rounds = [workload(a, min(a.vocab, 1024), a.seed + r) for r in range(a.rounds)]
        for clients in a.clients:
            rows += interleaved(a, folder, rounds, clients)
        profiles = [engine_profile(folder, rounds[0], c)
                    for c in (a.clients if a.profile else ())]
    print(f"\n{a.requests} requests a round ({a.rounds} rounds, seeds {a.seed}.."
          f"{a.seed + a.rounds - 1}), prompts {a.prompt[0]}..{a.prompt[1]} tokens, outputs "
          f"{a.output[0]}..{a.output[1]} ({a.lengths}), "
          + (f"Poisson arrivals at {a.rate}/s" if a.rate > 0 else "closed loop")
          + f"; d_model {a.d_model} x {a.layers} layers, vocab {a.vocab}; CPU: {cpu_name()}")
    print(table(rows))
    print(ratios(rows, baseline="static"))
    for p in profiles:
        print("engine alone:", json.dumps({k: round(v, 3) for k, v in p.items()}))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
