"""The serving engine's compiled programs (jaxformer.serve.paged_step, the paged layout of
jaxformer.attention.paged_cache): a decode step runs the decoding rows alone, not every
slot, and a prompt chunk runs as many rows as prompts wait (not PREFILL_ROWS, padded) and
is as wide as the prompt's rest needs, not prefill_chunk; the LM
head runs at each row's last token alone ([R, V], not [R * T, V]); the pool is donated and
updated in place (no copy of it); page_view gathers whole pages, and a decode step only
the pages its rows hold (a (row, page) pair each, not rows x the longest row's). Read from the compiled HLO
of one tiny engine's programs, not from timings; Engine.warm compiles every program a
step may run beforehand."""

import math
import re

import jax
import jax.numpy as jnp

from jaxformer import ModelConfig, Transformer
from jaxformer.serve import Engine, RequestSettings

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=64, norm="rmsnorm", ffn="swiglu", position="rope")


def compiled_programs():
    """The engine's shapes run and the compiled HLO text of each program it called, for one
    request of 40 tokens (one prompt chunk of 64 in one row, not 4) and 2 new ones in 16
    slots."""
    model = Transformer(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    engine = Engine(model, params, slots=16, page_size=8, prefill_chunk=64)
    program, calls = engine.program, {}
    warmed = engine.warm()  # chunks of 32 in 4 rows, of 64 in 1, 2, 4 x table widths 4, 8;
    # decode steps of 8 rows x 32, 48, 64 pairs and of 16 rows x 64, 96, 128
    compiled = program._cache_size()

    def spy(params, pool, *args):
        calls[args[0].shape] = (params, pool, *args)
        return program(params, pool, *args)
    engine.program = spy
    engine.submit(list(range(1, 41)), RequestSettings(max_tokens=2, temperature=0.0))
    while engine.has_work():
        engine.step()
    texts = {shape: (program.lower(*args).compile().as_text(), args)
             for shape, args in calls.items()}
    assert (warmed, program._cache_size()) == (14, compiled)  # warm compiled every one
    return engine.shapes, texts


def test_programs_run_the_decoding_rows_the_last_tokens_head_and_the_pool_in_place():
    shapes, texts = compiled_programs()
    assert {(rows, chunk) for rows, chunk, _ in shapes} == {(1, 64), (8, 1)}  # not 4, 16
    v, pool = CFG.vocab_size, r"f32\[\d+,2,8,8\]"  # [pages, K, page_size, head_dim]
    for (rows, chunk), (hlo, args) in texts.items():
        head = [re.search(rf"= f32\[([\d,]*){v}\]", x) for x in hlo.splitlines()
                if "Transformer.logits/" in x]  # arrays of the head's, V their last axis
        sizes = [math.prod(int(d) for d in m.group(1).split(",") if d) for m in head if m]
        assert sizes and max(sizes) == rows, sizes  # [R, V]: not [R, T, V]
        assert "input_output_alias" in hlo
        assert not re.search(rf"= {pool}\S* copy\(", hlo)  # the pool is not copied
        # each layer's k and v read as whole pages: [R, M, K, page_size, H] (XLA may put M
        # first); a decode step's
        # as its pairs' [P, K, page_size, H]: a row of 41 tokens holds 6 pages of 8, padded to
        # 32 pairs (8 rows x 32 keys), not 8 rows x its table's 8 pages
        pairs = None if chunk > 1 else args[11][0]  # (params, pool, *the step's arguments)
        assert pairs is None or (len(pairs), sum(pairs < rows)) == (32, 6)
        pages = rf"(?:{rows},\d+|\d+,{rows})" if pairs is None else rf"{len(pairs)}(?:,1)?"
        gathers = re.findall(rf"= f32\[{pages},2,8,8\]\S* gather\(", hlo)
        assert len(gathers) == 2 * CFG.n_layers, hlo.count("gather(")
