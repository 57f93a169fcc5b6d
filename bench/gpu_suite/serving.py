"""Section 5: the serving engine (jaxformer.serve.Engine: continuous batching over a
paged KV cache) on the 1B config with bf16 params at 1, 16 and 64 concurrent sequences,
each a greedy request of `prompt` tokens and `new_tokens` new ones (min_tokens: no early
end), against the memory roofline as section 4 counts it: (param bytes + the KV cache
bytes of the sequences at their full length) read per step over the copy bandwidth
measured in the same run. The first pass compiles the engine's programs; the median of
`repeats` more is timed, submission to the last token (prefill included, as generate's
time includes its prefill)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gpu_suite.decoding import median_seconds
from gpu_suite.sizes import Sizes
from gpu_suite.train_step import train_models
from jaxformer import Transformer
from jaxformer.decode import kv_cache_bytes
from jaxformer.serve.engine import Engine, RequestSettings

PAGE = 16  # tokens per page


def served(engine: Engine, prompts: np.ndarray, new: int) -> int:
    """Serve every prompt (greedy, exactly `new` tokens each); the tokens made."""
    settings = RequestSettings(max_tokens=new, min_tokens=new, temperature=0.0)
    for p in prompts:
        engine.submit(p.tolist(), settings)
    made = 0
    while engine.has_work():
        made += sum(e.token >= 0 for e in engine.step())
    return made


def serve_rows(sizes: Sizes, bandwidth: float, repeats: int) -> list[dict]:
    """Engine tokens/s on the 1B config, bf16 params, per count of concurrent sequences."""
    name, cfg, _ = train_models(sizes)[1]
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    model = Transformer(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tokens = sizes.prompt + sizes.new_tokens
    rows = []
    for batch in sizes.serve_batches:
        engine = Engine(model, params, slots=batch, page_size=PAGE,
                        pages=max(batch * -(-tokens // PAGE) + batch, -(-cfg.max_seq_len // PAGE)))
        prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, sizes.prompt))
        made = []

        def run(prompts=prompts, engine=engine):
            made.append(served(engine, prompts, sizes.new_tokens))
            return jnp.zeros(())

        first, seconds = median_seconds(run, repeats)
        tok_s = batch * sizes.new_tokens / seconds
        per_step = param_bytes + kv_cache_bytes(cfg, batch, tokens, jnp.bfloat16)
        roofline = batch * bandwidth / per_step
        rows.append({"model": name, "sequences": batch, "prompt": sizes.prompt,
                     "new_tokens": sizes.new_tokens, "tokens_per_s": tok_s,
                     "tokens_made": made[-1], "compile_s": first - seconds,
                     "steps": engine.stats()["steps"], "bytes_per_step": per_step,
                     "roofline_tokens_per_s": roofline, "of_roofline": tok_s / roofline})
    return rows
