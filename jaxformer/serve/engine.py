"""The serving engine: continuous batching over a paged KV cache.

Requests wait in a queue (FIFO) and are admitted between steps into free slots of a
fixed-shape batch; a prompt goes through in chunks of `prefill_chunk` tokens (a few
prompts' chunks per step) beside the other slots' decode steps; a request's pages are
released the moment it ends or is cancelled. The keys and values live in a pool of pages
(jaxformer.attention.paged_cache's layout, jaxformer.serve.pages' bookkeeping), so
memory follows the tokens held, and a prompt's full pages are shared with every later
request that starts with the same tokens (prefix caching; not for models with recurrent
layers, whose state at the end of a prefix is not kept).

Each token is sampled with its request's own settings (jaxformer.decode.sampling) and its
own key stream: fold_in(the seed's key, the token's number), so a seeded request gives the
same tokens whatever runs beside it; its log-prob is the model's log-softmax, as
generate's (jaxformer.core.logprobs).

The pages hold keys and values in `cache_dtype` (jaxformer.attention.cache_formats: the
model's dtype by default, or int8 with a float32 scale per token and head: 0.27x the bytes
of float32 at head_dim 64), quantised as generate(..., cache_dtype="int8") quantises them,
so a request gets that generate's tokens.

`hooks` ({name: fn}, TransformerLens names, as generate and
jaxformer.model.inspect.run_with_hooks take them) are applied to every request: to each
prompt chunk's values and each new token's (a steering vector, an ablated head), so a
request gets generate(..., hooks=the same)'s tokens and log-probs.

A model whose every attention layer has a sliding window (window_of) releases a request's
pages as they fall wholly behind the window of its next token: a sequence then holds
about window / page_size + 1 pages however long it runs, and its decode steps read those
alone.

When the pool runs short in a decode step, the request admitted last is preempted: its
pages are released and it goes back to the front of the queue, to be fed again (prompt
and tokens so far) when pages are free; what it emitted stands. A waiting request is
admitted only when its whole prompt's pages are available.

Programs compiled (jaxformer.serve.paged_step; their shapes jaxformer.serve.shapes): per
page-table width (powers of two from LEAST_KEYS / page_size up to max_seq_len / page_size),
one per prompt chunk (width: powers of two from LEAST_CHUNK up to prefill_chunk, as wide as
its longest row's rest; rows: as many as the prompts waiting, a power of two up to
PREFILL_ROWS, not PREFILL_ROWS padded, for a chunk wider than LEAST_CHUNK) and one per
decode row count (powers of two from LEAST_ROWS up to the slots: a decode step runs its
decoding slots alone, packed into the first rows); two for max_seq_len <= LEAST_KEYS, slots
<= LEAST_ROWS and prefill_chunk <= LEAST_CHUNK. A model whose attention reads (row, page)
pairs (paged_step.decodes_by_pairs), in pages of PAIR_PAGES tokens or more, decodes over
each row's own pages: one decode program per row count and pair count (pair_count: 2^k and
3 x 2^(k-1), from LEAST_KEYS / page_size a row), not per table width. Not thread-safe: one
thread calls submit, cancel and step.
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention.paged_cache import init_pages
from jaxformer.core.sharding import param_shardings, resolve_rules
from jaxformer.decode.cached_forward import looped
from jaxformer.decode.sampling import Sampling
from jaxformer.model.archs import ARCHS
from jaxformer.model.transformer import Transformer
from jaxformer.serve.pages import PagePool, chain_hashes
from jaxformer.serve.paged_step import checked_hooks, decodes_by_pairs, step_program, window_of
from jaxformer.serve.requests import (TOP_LOGPROBS, Event, Request, RequestSettings,
                                      checked_request)
from jaxformer.serve.shapes import (LEAST_CHUNK, LEAST_KEYS, LEAST_ROWS, PAIR_PAGES,
                                    PREFILL_ROWS, pair_count, pairs_of, table_width)


class Engine:
    """Continuous batching over a paged KV cache (the module docstring says how)."""

    def __init__(self, model, params, *, slots: int = 32, page_size: int = 16,
                 pages: int | None = None, prefill_chunk: int = 128, mesh=None,
                 cache_dtype=None, hooks=None):
        cfg = model.cfg
        if ARCHS[cfg.arch].module != Transformer.__name__ or not cfg.generates:
            raise ValueError(f"model.arch={cfg.arch} is not served (the engine runs a decoder, "
                             "model.arch=decoder)")
        for name, value in (("slots", slots), ("page_size", page_size),
                            ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.vocab_size, self.max_seq_len = cfg.vocab_size, cfg.max_seq_len
        self.slots, self.page_size, self.prefill_chunk = slots, page_size, prefill_chunk
        self.max_pages = -(-cfg.max_seq_len // page_size)  # a sequence's most pages
        pages = slots * self.max_pages if pages is None else pages
        if not isinstance(pages, int) or pages < self.max_pages:
            raise ValueError(f"pages={pages!r} cannot hold one sequence of max_seq_len="
                             f"{cfg.max_seq_len}; pass pages >= {self.max_pages}")
        decoding, self.unstack = looped(cfg)
        self.cfg, self.decoding, self.mesh = decoding.cfg, decoding, mesh
        rules = None if mesh is None else resolve_rules()
        self.rules = rules
        self.params = self.placed(params)
        self.host = PagePool(pages, page_size)
        self.pool = init_pages(self.cfg, pages, page_size, slots, cache_dtype)
        self.tables = np.full((slots, self.max_pages), pages, np.int32)  # pages: none
        self.prefix = not cfg.recurrent  # a recurrent state is not kept per prefix
        self.window = window_of(self.cfg)  # pages behind it are released (None: none are)
        # decode steps over each row's own pages, where a page holds several keys: with pages
        # of one token (GRPO's rollouts) the segment sums cost more than the table's padding
        self.pairs = decodes_by_pairs(self.cfg) and page_size >= PAIR_PAGES
        self.least = -(-LEAST_KEYS // page_size)  # the fewest pages a forward reads a row
        if hooks:
            checked_hooks(model, params, hooks)
        self.program = step_program(self.cfg, min(TOP_LOGPROBS, cfg.vocab_size), mesh, rules,
                                    hooks)
        self.by_slot: list[Request | None] = [None] * slots
        self.running: list[Request] = []  # in order of admission
        self.waiting: collections.deque[Request] = collections.deque()
        self.requests: dict[int, Request] = {}
        self.pending: list[Event] = []  # cancellations, reported by the next step
        self.next_id, self.steps, self.preempted, self.shapes = 0, 0, 0, set()
        self.rng = np.random.default_rng()  # the seeds of requests that give none
        self.no_bans: dict[int, jax.Array] = {}
        self.computing: set[int] = set()  # hashes of prompt pages admitted, not yet computed

    def placed(self, params):
        """The model's param tree (as trained) as the programs read it: unstacked, and on
        the mesh's devices when there is one."""
        params = self.unstack(params)
        if self.mesh is None:
            return params
        return jax.device_put(params, param_shardings(self.decoding, self.mesh, self.rules))

    def use_params(self, params) -> None:
        """Serve these weights (the model's param tree, as trained) from the next step on:
        the compiled programs and the pool stay; the cached prefixes, computed with the old
        weights, are forgotten. Call it between steps with no request running."""
        if self.running:
            raise ValueError(f"use_params with {len(self.running)} requests running: call it "
                             "when has_work() is false")
        self.params = self.placed(params)
        self.host.forget()

    # ---- requests ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], settings: RequestSettings) -> int:
        """Queue a request; its id. A ValueError of one line names a bad prompt or setting."""
        ids = checked_request(prompt, settings, self.vocab_size, self.max_seq_len)
        seed = int(self.rng.integers(2**63) if settings.seed is None else settings.seed)
        req = Request(self.next_id, settings, ids, len(ids), (seed & 0xFFFFFFFF, seed >> 32))
        self.next_id += 1
        self.requests[req.id] = req
        self.waiting.append(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        """End a request now: its slot and pages are freed; the next step reports it
        (token -1, finished "cancelled"). A request ended already: nothing."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.slot is None:
            self.waiting.remove(req)
        self.end(req)
        self.pending.append(Event(request_id, -1, 0.0, (), "cancelled"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    def stats(self) -> dict:
        """{"slots", "running", "waiting", "pages_total", "pages_free", "pages_cached",
        "pages_held", "steps", "preempted" (requests sent back to the queue), "programs"
        (the shapes run, each a compiled program)}."""
        return {"slots": self.slots, "running": len(self.running),
                "waiting": len(self.waiting), **self.host.counts(), "steps": self.steps,
                "preempted": self.preempted, "programs": len(self.shapes)}

    # ---- slots and pages -----------------------------------------------------------------

    def end(self, req: Request) -> None:
        """A request leaves: its pages released, its slot freed."""
        self.unslot(req)
        del self.requests[req.id]

    def unslot(self, req: Request) -> None:
        """A running request leaves its slot and pages (nothing for a waiting one)."""
        if req.slot is None:
            return
        self.host.release(req.pages[req.dropped:])
        self.computing.difference_update(chain_hashes(req.tokens[:-1], self.page_size))
        self.tables[req.slot] = self.host.pages
        self.by_slot[req.slot] = None
        self.running.remove(req)
        req.slot, req.pages, req.hashes, req.held, req.dropped = None, [], [], 0, 0

    def admit(self) -> None:
        """Waiting requests into free slots, first come first served, while the pool has
        their prompts' pages (a prefix cached already: held, not computed again). One whose
        prefix a running prompt is computing waits for it, a step or a few, in its place;
        the requests behind it are admitted meanwhile."""
        held = []  # waiting for a prefix being computed
        while self.waiting and None in self.by_slot:
            req = self.waiting.popleft()
            ps = self.page_size
            hashes = chain_hashes(req.tokens[:-1], ps) if self.prefix else []
            if any(h in self.computing for h in hashes):
                held.append(req)  # shared once computed
                continue
            shared = self.host.lookup(hashes)  # (the last token always runs: its logits)
            new = self.host.take(-(-len(req.tokens) // ps) - len(shared))
            if new is None:
                self.host.release(shared)
                self.waiting.appendleft(req)
                break
            req.slot = self.by_slot.index(None)
            self.by_slot[req.slot] = req
            self.running.append(req)
            req.pages, req.hashes, req.held = shared + new, hashes[:len(shared)], len(shared) * ps
            self.tables[req.slot, :len(req.pages)] = req.pages
            self.computing.update(hashes[len(shared):])
        self.waiting.extendleft(reversed(held))

    def grow(self, req: Request, length: int) -> bool:
        """Pages for req's first `length` tokens, preempting the requests admitted last
        while the pool is short; False when req itself was preempted."""
        while len(req.pages) < -(-length // self.page_size):
            page = self.host.take(1)
            if page is None:
                victim = self.running[-1]
                self.unslot(victim)
                self.preempted += 1
                self.waiting.appendleft(victim)
                if victim is req:
                    return False
                continue
            self.tables[req.slot, len(req.pages)] = page[0]
            req.pages.append(page[0])
        return True

    def learn_pages(self, req: Request) -> None:
        """req's pages filled since the last call, known to the prefix cache."""
        full = req.held // self.page_size
        previous = req.hashes[-1] if req.hashes else None
        new = chain_hashes(req.tokens[:full * self.page_size], self.page_size,
                           len(req.hashes), previous)
        for i, h in enumerate(new, len(req.hashes)):
            if self.prefix:
                self.host.register(req.pages[i], h)
            self.computing.discard(h)
        req.hashes += new

    def drop_behind(self, req: Request) -> None:
        """req's first pages that no later token reads (wholly before the window of its
        next position, req.held) released, once the prefix cache knows them."""
        if self.window is None:
            return
        behind = max(0, (req.held - self.window + 1) // self.page_size)
        if behind > req.dropped:
            self.host.release(req.pages[req.dropped:behind])
            self.tables[req.slot, req.dropped:behind] = self.host.pages
            req.dropped = behind

    # ---- steps ---------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One iteration: admit waiting requests, run a chunk of up to PREFILL_ROWS prompts,
        then one decode step of every slot with a token to feed; the events of both."""
        events, self.pending = self.pending, []
        self.admit()
        prefill = [r for r in self.running if len(r.tokens) - r.held > 1]
        if prefill:  # a chunk as wide as its longest row's rest needs (a power of two)
            prefill = prefill[:min(PREFILL_ROWS, self.slots)]
            chunk = table_width(max(len(r.tokens) - r.held for r in prefill),
                                self.prefill_chunk, LEAST_CHUNK)
            events += self.run(prefill, chunk, self.prompt_rows(len(prefill), chunk))
        decode = [r for r in self.running if len(r.tokens) - r.held == 1]
        if decode:
            events += self.run(decode, 1, table_width(len(decode), self.slots, LEAST_ROWS))
        self.steps += 1
        return events

    def prompt_rows(self, prompts: int, chunk: int) -> int:
        """The rows a prompt chunk runs: as many as the prompts (a power of two) when the
        chunk is wider than LEAST_CHUNK, else PREFILL_ROWS (that padding costs less than
        another program); at most the slots."""
        most = min(PREFILL_ROWS, self.slots)
        return most if chunk <= LEAST_CHUNK else table_width(prompts, most)

    def run(self, reqs: list[Request], chunk: int, rows: int) -> list[Event]:
        """One program over `rows` rows: each of reqs' next `chunk` tokens at most (the
        rest padding), a token sampled for those that reach their last."""
        counts = {r.id: min(chunk, len(r.tokens) - r.held) for r in reqs}
        reqs = [r for r in reqs if r.slot is not None and self.grow(r, r.held + counts[r.id])]
        reqs = [r for r in reqs if r.slot is not None]  # (a later one may have preempted it)
        if not reqs:
            return []
        args, width = self.arguments(reqs, counts, chunk, rows)
        self.shapes.add((rows, chunk, width))
        self.pool, out = self.program(self.params, self.pool, *args)
        tokens, logps, top_ids, top_logps = jax.device_get(out)
        events = []
        for i, req in enumerate(reqs):
            req.held += counts[req.id]
            self.learn_pages(req)
            self.drop_behind(req)
            if req.held == len(req.tokens):
                events.append(self.emitted(req, int(tokens[i]), float(logps[i]),
                                           top_ids[i], top_logps[i]))
        return events

    def arguments(self, reqs, counts, chunk: int, rows: int) -> tuple:
        """(the program's inputs after (params, pool) for reqs in rows 0.., padding after;
        the keys' shape it runs: its page-table width, or a decode step's pair count)."""
        n = len(reqs)
        tokens = np.zeros((rows, chunk), np.int32)
        starts, count = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for i, r in enumerate(reqs):
            feed = r.tokens[r.held:r.held + counts[r.id]]
            tokens[i, :len(feed)], starts[i], count[i] = feed, r.held, len(feed)
        # the pages each row reads after this chunk (a prompt holds all its pages from
        # admission on: its first chunks read fewer)
        held = [-(-(r.held + counts[r.id]) // self.page_size) for r in reqs]
        by_pairs = chunk == 1 and self.pairs
        width = self.max_pages if by_pairs else table_width(max(held), self.max_pages,
                                                             self.least)
        slot_of = np.array([r.slot for r in reqs] + [self.slots] * (rows - n), np.int32)
        table = np.full((rows, width), self.host.pages, np.int32)
        table[:n] = self.tables[slot_of[:n], :width]
        s = [r.settings for r in reqs] + [RequestSettings(temperature=0.0)] * (rows - n)
        sampling = Sampling(np.array([x.temperature for x in s], np.float32),
                            np.array([x.top_k for x in s], np.int32),
                            np.array([x.top_p for x in s], np.float32),
                            np.array([x.min_p for x in s], np.float32))
        seeds = np.array([r.seed for r in reqs] + [(0, 0)] * (rows - n), np.uint32)
        index = np.array([r.generated for r in reqs] + [0] * (rows - n), np.int32)
        args = (tokens, starts, count, table, slot_of, sampling, seeds, index,
                self.bans(reqs, rows))
        if not by_pairs:
            return args, width
        pairs = pairs_of(table, held, [r.dropped for r in reqs], rows, self.max_pages,
                         self.least, self.host.pages)
        return args + (pairs,), len(pairs[0])

    def warm(self) -> int:
        """Compile every program a step may run (each shape once, its rows all padding:
        nothing written), so that no request waits for a compile; how many shapes."""
        widths = {table_width(p, self.max_pages, self.least)
                  for p in range(1, self.max_pages + 1)}
        chunks = {table_width(n, self.prefill_chunk, LEAST_CHUNK)
                  for n in range(2, self.prefill_chunk + 1)} or {1}
        rows = {table_width(n, self.slots, LEAST_ROWS) for n in range(1, self.slots + 1)}
        prompts = range(1, min(PREFILL_ROWS, self.slots) + 1)
        shapes = {(self.prompt_rows(n, c), c, w) for n in prompts for c in chunks
                  for w in widths}
        for r in rows:  # a decode step's: table widths, or pair counts
            shapes |= {(r, 1, w) for w in widths} if not self.pairs else {
                (r, 1, pair_count(n, r * self.max_pages, r * self.least))
                for n in range(1, r * self.max_pages + 1)}
        for r, c, w in sorted(shapes):
            none = np.full(r, self.slots, np.int32)  # a padding row's slot and page: none
            greedy = Sampling(np.zeros(r, np.float32), np.zeros(r, np.int32),
                              np.ones(r, np.float32), np.zeros(r, np.float32))
            pairs = c == 1 and self.pairs
            table = np.full((r, self.max_pages if pairs else w), self.host.pages, np.int32)
            args = (np.zeros((r, c), np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32),
                    table, none, greedy, np.zeros((r, 2), np.uint32), np.zeros(r, np.int32),
                    self.bans([], r))
            if pairs:  # every pair padding: nothing read, nothing written
                args += ((np.full(w, r, np.int32), np.full(w, self.host.pages, np.int32),
                          np.zeros(w, np.int32)),)
            self.pool, out = self.program(self.params, self.pool, *args)
            jax.block_until_ready(out)
        return len(shapes)

    def bans(self, reqs, rows: int):
        """bool [rows, V]: the tokens each request may not emit next (its constraints)."""
        banned = [r.bans() for r in reqs]
        if not any(banned):
            if rows not in self.no_bans:
                self.no_bans[rows] = jnp.zeros((rows, self.vocab_size), bool)
            return self.no_bans[rows]
        out = np.zeros((rows, self.vocab_size), bool)
        for i, b in enumerate(banned):
            out[i, list(b)] = True
        return out

    def emitted(self, req: Request, token: int, logp: float, top_ids, top_logps) -> Event:
        """req's new token recorded; its event (and its end, when it ends)."""
        req.append(token)
        k = req.settings.logprobs
        top = tuple((int(t), float(p)) for t, p in zip(top_ids[:k], top_logps[:k]))
        finished = req.finish_reason()
        if finished:
            self.end(req)
        return Event(req.id, token, logp, top, finished)
