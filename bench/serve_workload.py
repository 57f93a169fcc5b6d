"""bench/serve.py's workload and its statistics: the requests (Job: arrival, prompt, output
length) drawn from the command line's settings, what each request saw (Timing), a table
row of throughput and latency percentiles (summary, table) and each system's rounds over
the static batch's (ratios); bench/engine_step.py draws its output lengths from the same
OUTPUTS."""

from __future__ import annotations

import dataclasses

import numpy as np

LOGNORMAL = (48, 1.0)  # --lengths lognormal: the median output length and sigma (of the log)
OUTPUTS = {  # --lengths: n output lengths within [lo, hi] from a numpy Generator
    "uniform": lambda draw, lo, hi, n: draw.integers(lo, hi + 1, n),
    "lognormal": lambda draw, lo, hi, n: np.clip(np.rint(draw.lognormal(
        np.log(LOGNORMAL[0]), LOGNORMAL[1], n)), lo, hi).astype(np.int64)}


@dataclasses.dataclass(frozen=True)
class Job:
    """One request of the workload: when it arrives (seconds from the start; 0 in a
    closed loop), its prompt's token ids and its output length."""
    arrival: float
    prompt: tuple[int, ...]
    new: int


@dataclasses.dataclass
class Timing:
    """What one request saw: its wait for the first token, the gaps between later ones,
    the tokens it got and when it ended (seconds from the start)."""
    ttft: float
    itl: list[float]
    tokens: int
    end: float


def workload(a, vocab: int, seed: int | None = None) -> list[Job]:
    """--requests jobs drawn from `seed` (None: --seed): prompt lengths uniform in
    --prompt, output lengths by --lengths in --output, Poisson arrivals at --rate (0: every
    job ready at once, the clients' closed loop paces them)."""
    draw = np.random.default_rng(a.seed if seed is None else seed)
    gaps = draw.exponential(1 / a.rate, a.requests) if a.rate > 0 else np.zeros(a.requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = draw.integers(a.prompt[0], a.prompt[1] + 1, a.requests)
    outputs = OUTPUTS[a.lengths](draw, *a.output, a.requests)
    return [Job(float(t), tuple(int(x) for x in draw.integers(1, vocab, int(p))), int(n))
            for t, p, n in zip(arrivals, prompts, outputs)]


def warm_up(jobs: list[Job], clients: int) -> list[Job]:
    """The untimed first pass: `clients` jobs with their prompts reversed, so that no
    prefix of the timed pass is cached by it."""
    return [dataclasses.replace(j, prompt=j.prompt[::-1]) for j in jobs[:clients]]


def summary(name: str, clients: int, timings: list[Timing], wall: float) -> dict:
    """A row of the table: throughput and latency percentiles (ms)."""
    ttft, itl = [t.ttft for t in timings], [x for t in timings for x in t.itl]
    tokens = sum(t.tokens for t in timings)
    row = {"system": name, "clients": clients, "requests": len(timings), "tokens": tokens,
           "tokens_per_s": tokens / wall, "requests_per_s": len(timings) / wall, "wall_s": wall}
    for kind, xs in (("ttft", ttft), ("itl", itl)):
        row.update({f"{kind}_p{q}": float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
                    for q in (50, 90, 99)})
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'system':<18}{'clients':>8}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p90':>8}"
            f"{'p99':>8}{'ITL p50':>9}{'p90':>7}{'p99':>7}  (ms)")
    lines = [head]
    for r in rows:
        lines.append(f"{r['system']:<18}{r['clients']:>8}{r['tokens_per_s']:>9.1f}"
                     f"{r['requests_per_s']:>8.2f}{r['ttft_p50']:>10.0f}{r['ttft_p90']:>8.0f}"
                     f"{r['ttft_p99']:>8.0f}{r['itl_p50']:>9.1f}{r['itl_p90']:>7.1f}"
                     f"{r['itl_p99']:>7.1f}")
    return "\n".join(lines)


def ratios(rows: list[dict], baseline: str) -> str:
    """Each system's tokens/s over the `baseline` system's (rows' "key") of the same round
    and clients, every round and their median."""
    base = {(r["clients"], r["round"]): r["tokens_per_s"] for r in rows if r["key"] == baseline}
    lines = []
    for key in dict.fromkeys(r["key"] for r in rows if r["key"] != baseline):
        for clients in dict.fromkeys(r["clients"] for r in rows):
            x = [r["tokens_per_s"] / base[clients, r["round"]] for r in rows
                 if r["key"] == key and r["clients"] == clients and (clients, r["round"]) in base]
            if x:
                lines.append(f"{key} / {baseline}, {clients} clients: median "
                             f"{np.median(x):.2f}x (rounds: {', '.join(f'{v:.2f}' for v in x)})")
    return "\n".join(lines)
