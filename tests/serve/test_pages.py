"""The pages of the serving engine (jaxformer.serve.pages, paged_cache's layout): the
pool's bookkeeping against a plain count, a prompt prefix shared by 32 requests held once
(and read right: generate's tokens), and the memory of 32 sequences of 100 tokens under a
tenth of 32 max_seq_len slots'."""

import jax
import numpy as np

from jaxformer import ModelConfig
from jaxformer.attention.kv_cache import kv_cache_bytes
from jaxformer.decode import generate
from jaxformer.serve import Engine, RequestSettings
from jaxformer.serve.pages import PagePool, chain_hashes
from tests.serve.test_engine import CFG, CHUNK, PAGE, alone, tiny

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture


def test_the_pool_counts_its_pages_as_a_plain_count_does():
    """Random takes, holds and releases of a pool with a prefix cache: each page's count is
    the holds minus the releases; a page counted 0 is free or cached (never both); cached
    pages are evicted least recently released first, and forgotten then."""
    pool, refs, known = PagePool(8, 4), np.zeros(8, int), {}
    for _ in range(400):
        held = [p for p in range(8) if refs[p] > 0]
        move = rng.integers(4)
        if move == 0 and (got := pool.take(int(rng.integers(1, 4)))) is not None:
            refs[got] += 1
        elif move == 1 and held:
            page = int(rng.choice(held))
            pool.release([page])
            refs[page] -= 1
        elif move == 2 and held:
            page, h = int(rng.choice(held)), int(rng.integers(5))
            pool.register(page, h)
            known.setdefault(h, page) if page not in known.values() else None
        elif move == 3:
            for page in pool.lookup([int(rng.integers(5))]):
                refs[page] += 1
        assert np.array_equal(pool.refs, refs)
        idle, free = list(pool.idle), pool.free
        assert sorted(idle + free + [p for p in range(8) if refs[p]]) == list(range(8))
        assert all(p in pool.hash_of for p in idle) and not set(idle) & set(free)
        known = {h: p for h, p in known.items() if pool.known.get(h) == p}
        assert known == pool.known
    rest = pool.take(pool.available)  # everything: the cached pages evicted, forgotten
    assert rest is not None and not pool.idle and pool.available == 0
    assert all(pool.refs[p] > 0 for p in pool.known.values())
    lru = PagePool(3, 4)
    a, b, c = lru.take(3)
    for page, h in ((a, 10), (b, 11), (c, 12)):
        lru.register(page, h)
    lru.release([b, a, c])  # released b first: evicted first
    assert lru.lookup([12]) == [c] and lru.take(1) == [b] and lru.known == {10: a, 12: c}


def test_chain_hashes_name_a_page_by_every_token_before_it():
    """Two sequences' page hashes agree up to the first page where they differ, and
    after it never again (the same page of tokens after another prefix is another page)."""
    a = rng.integers(0, 9, 40).tolist()
    b = a[:12] + [(a[12] + 1) % 9] + a[13:]
    ha, hb = chain_hashes(a, 4), chain_hashes(b, 4)
    assert len(ha) == 10 and ha[:3] == hb[:3] and all(x != y for x, y in zip(ha[3:], hb[3:]))
    assert chain_hashes(a, 4, 3, ha[2]) == ha[3:]


def test_a_prefix_shared_by_32_requests_is_held_once():
    """32 requests whose prompts start with the same two pages, submitted together: those
    pages are computed once and held once by all of them (each request holds its own
    pages after them alone), and each gets generate's tokens for it alone."""
    model, params = tiny()
    prefix = rng.integers(0, CFG.vocab_size, 2 * PAGE).tolist()
    prompts = [prefix + rng.integers(0, CFG.vocab_size, int(rng.integers(1, 5))).tolist()
               for _ in range(32)]
    settings = RequestSettings(max_tokens=10, temperature=0.0)
    engine = Engine(model, params, slots=32, page_size=PAGE, prefill_chunk=CHUNK)
    ids = [engine.submit(p, settings) for p in prompts]
    out = {i: [] for i in ids}
    most, shared = 0, None
    while engine.has_work():
        for e in engine.step():
            out[e.request_id].append(e.token)
        running = engine.running
        if running and all(len(r.pages) >= 2 for r in running):
            heads = {tuple(r.pages[:2]) for r in running}
            assert len(heads) == 1  # one copy of the prefix
            shared = shared or heads.pop()
            assert tuple(running[0].pages[:2]) == shared
            assert all(engine.host.refs[p] == len(running) for p in shared)
            own = sum(len(r.pages) - 2 for r in running)
            assert engine.stats()["pages_held"] == 2 + own
            most = max(most, len(running))
    assert most == 32
    for i, p in zip(ids, prompts):
        assert out[i] == alone(model, params, p, 10)


def test_32_sequences_of_100_tokens_hold_under_a_tenth_of_32_full_slots():
    """A model of max_seq_len 2048: 32 requests of 100 tokens (90 of prompt, 10 new) run
    together in a pool of 256 pages of 16; the pages they hold at the most, and the pool's
    bytes, are under a tenth of a cache of 32 rows of max_seq_len. Then one of 302 tokens
    (a wider page table) gets generate's tokens."""
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                      max_seq_len=2048, position="rope")
    model, params = tiny(cfg)
    engine = Engine(model, params, slots=32, page_size=16, pages=256, prefill_chunk=128)
    requests = [(rng.integers(0, 64, 90).tolist(), RequestSettings(max_tokens=10))
                for _ in range(32)]
    most, together = 0, 0
    out = {}
    for prompt, s in requests:
        out[engine.submit(prompt, s)] = []
    while engine.has_work():
        for e in engine.step():
            out[e.request_id].append(e.token)
        most = max(most, engine.stats()["pages_held"])
        together = max(together, engine.stats()["running"])
    full = 32 * cfg.max_seq_len // 16  # pages of 32 full-length slots
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.pool))
    assert together == 32 and all(len(t) == 10 for t in out.values())
    assert most <= 32 * 7 < full / 10
    assert pool_bytes < kv_cache_bytes(cfg, 32, cfg.max_seq_len) / 10
    # a longer one crosses into a wider page table (19 pages of 16): generate's tokens
    long = rng.integers(0, 64, 290).tolist()
    rid = engine.submit(long, RequestSettings(max_tokens=12, temperature=0.0))
    got = [e.token for _ in range(40) for e in engine.step() if e.request_id == rid]
    want = generate(model, params, np.array([long]), max_new_tokens=12, rng=jax.random.key(0),
                    temperature=0.0)
    assert got == np.asarray(want.tokens[0]).tolist() and not engine.has_work()
    # prompt chunks' table widths run: the pages filled; the long one decoding alone reads
    # its 19-20 pages as 32 (row, page) pairs, not 8 rows x a table of 32 pages
    assert {w for _, c, w in engine.shapes if c > 1} == {8, 16, 32}
    assert (8, 1, 32) in engine.shapes and max(w for _, c, w in engine.shapes if c == 1) == 256


def test_a_request_waiting_for_a_prefix_being_computed_holds_no_one_back():
    """A's prompt (three pages) is being computed; B, submitted next, starts with A's first
    two pages and waits for them in its place; C, a prompt of its own submitted after B,
    runs from the first step rather than behind B. Each gets generate's tokens alone."""
    model, params = tiny()
    a = rng.integers(0, CFG.vocab_size, 2 * PAGE + 2).tolist()
    b = a[:2 * PAGE] + rng.integers(0, CFG.vocab_size, 2).tolist()
    c = rng.integers(0, CFG.vocab_size, int(rng.integers(1, PAGE))).tolist()
    settings = RequestSettings(max_tokens=10, temperature=0.0)
    engine = Engine(model, params, slots=4, page_size=PAGE, prefill_chunk=CHUNK)
    ids = [engine.submit(p, settings) for p in (a, b, c)]
    out = {i: [] for i in ids}
    first = True
    while engine.has_work():
        for e in engine.step():
            out[e.request_id].append(e.token)
        if first:
            assert [r.id for r in engine.running] == [ids[0], ids[2]]
            assert [r.id for r in engine.waiting] == [ids[1]]
            first = False
    for i, p in zip(ids, (a, b, c)):
        assert out[i] == alone(model, params, p, 10)
    assert engine.stats()["pages_free"] + engine.stats()["pages_cached"] == \
        engine.stats()["pages_total"]
