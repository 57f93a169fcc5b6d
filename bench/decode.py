"""Decoding speed.

    python bench/decode.py [--new-tokens 256 --prompt 256 --draft-len 4 --repeats 3
        --steps 300 --runs runs/bench_decode --torch-threads 1]

The default: batch-1 generation at the memory limit, float32 / bfloat16 / int8 weights,
plain, prompt lookup and a draft model, beside HF generate and assisted generation on the
same trained weights: tokens/s, bytes read per token, % of the weight-read roofline,
acceptance rate (bench/decode_limit.py says how each is measured).

    python bench/decode.py --shapes [--layers 4 --d-model 256 --heads 4 --vocab 256
        --prompt 16 --new-tokens 256 --batches 1 16 --repeats 3 --torch-threads 1 2]

--shapes: the KV-cached lax.scan decoder, a jitted loop that recomputes the whole
sequence for every token, and (with torch and transformers installed) HF transformers'
generate() on a GPT-2 of the same shape in PyTorch, random weights; tokens/s and ratios.
With --no-repeat-ngram-size N both decode under that constraint (jaxformer.decode.constraints;
HF's NoRepeatNGramLogitsProcessor), and the first row is the plain decoder for its cost.

    python bench/decode.py --windowed [--layers 6 --window 64 --new-tokens 1024 ...]

--windowed: a Gemma 3-shaped model instead (five local layers with a sliding window to one
global, GQA with one K/V head, QK-norm, sandwich norms, GeGLU), decoded with a windowed KV
cache (each local layer a ring of `window` slots) against a full-length one: KV-cache bytes
and tokens/s.

    python bench/decode.py --mla [--layers 4 --d-model 256 --heads 8 --new-tokens 256 ...]

--mla: a DeepSeek-V3-shaped model (multi-head latent attention with a low-rank query; its
ranks scaled from V3's 7168 / 1536 / 512 / 128 + 64 / 128 to d_model) against a GQA model
(2 K/V heads) of about the same parameter count, both with a dense SwiGLU: parameters,
KV-cache bytes per token and tokens/s; then MLA's prefill in the absorbed form against the
cache's latents expanded, ms at prompts of 16 to 1,024 tokens.

Greedy decoding, float32. Every decoder runs once to compile / warm up, then once per round,
rounds interleaved (load from other processes on a shared machine falls on all alike);
times are medians over rounds. HF runs at each --torch-threads count: on a busy 2-core
machine two OpenMP threads can be many times slower than one, so compare with the faster.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import ModelConfig, Transformer, count_params
from jaxformer.decode import generate, kv_cache_bytes
from jaxformer.decode.constraints import Constraints
from jaxformer.model.config import PRESETS


def median_times(fns, repeats):
    """{name: median seconds}: each fn once to warm up, then `repeats` rounds of each once."""
    for fn in fns.values():
        fn()  # compile / warm up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def recompute_fn(model, new_tokens):
    """Greedy decoding that runs the full forward over a fixed buffer for every token."""
    @jax.jit
    def run(params, prompts):
        b, w = prompts.shape
        buf = jnp.zeros((b, w + new_tokens), jnp.int32).at[:, :w].set(prompts)

        def body(i, buf):
            logits = model.apply({"params": params}, buf)
            tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i - 1, 1, False), -1)
            return jax.lax.dynamic_update_index_in_dim(buf, tok.astype(jnp.int32), i, 1)

        return jax.lax.fori_loop(w, w + new_tokens, body, buf)[:, w:]
    return run


def gemma3_shaped(a, max_len: int) -> ModelConfig:
    """A small Gemma 3: 5 local (window a.window, RoPE base 10k) : 1 global (1M) layers."""
    return ModelConfig(
        vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
        n_kv_heads=1, head_dim=a.d_model // a.heads, d_ff=4 * a.d_model, max_seq_len=max_len,
        position="rope", rope_theta=1e6, norm="rmsnorm_offset", block="sandwich",
        ffn="geglu", use_bias=False, qk_norm="head", tie_embeddings=True,
        embed_multiplier=a.d_model ** 0.5, layer_pattern=("local",) * 5 + ("global",),
        layer_kinds={"local": {"window": a.window, "rope_theta": 1e4}, "global": {}})


def windowed_table(a):
    """Windowed against full-length KV caches on a Gemma 3-shaped model."""
    max_len = a.prompt + a.new_tokens
    cfg = gemma3_shaped(a, max_len)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    print(f"device: {jax.devices()[0].device_kind}; Gemma 3 shape: {a.layers} layers (5 local "
          f"with window {a.window} : 1 global), d_model {a.d_model}, {a.heads} heads, 1 K/V "
          f"head, vocab {a.vocab}, float32; prompt {a.prompt}, {a.new_tokens} new tokens, greedy")
    header = f"{'KV cache':<12} {'batch':>5} {'cache MiB':>10} {'seconds':>9} {'tokens/s':>10} " \
             f"{'vs full':>8}"
    print(header)
    print("-" * len(header))
    for batch in a.batches:
        prompts = np.random.default_rng(0).integers(0, a.vocab, (batch, a.prompt)).astype(np.int32)
        run = lambda windowed: lambda: generate(  # noqa: E731
            model, params, prompts, max_new_tokens=a.new_tokens, rng=jax.random.key(0),
            temperature=0.0, windowed_cache=windowed).tokens.block_until_ready()
        times = median_times({"full": run(False), "windowed": run(True)}, a.repeats)
        for name, sec in times.items():
            mib = kv_cache_bytes(cfg, batch, max_len, windowed=name == "windowed") / 2**20
            print(f"{name:<12} {batch:>5} {mib:>10.2f} {sec:>9.3f} "
                  f"{batch * a.new_tokens / sec:>10,.0f} {times['full'] / sec:>7.2f}x")


def mla_table(a):
    """MLA's latent cache against GQA's K/V cache, at about the same parameter count."""
    max_len = a.prompt + a.new_tokens
    d, h = a.d_model, a.heads
    head = d // h
    common = dict(vocab_size=a.vocab, d_model=d, n_layers=a.layers, n_heads=h,
                  max_seq_len=max_len, position="rope", norm="rmsnorm", ffn="swiglu",
                  use_bias=False, tie_embeddings=False)
    mla = dict(q_lora_rank=3 * d // 8, kv_lora_rank=d // 4, qk_nope_head_dim=head,
               qk_rope_head_dim=head // 2, v_head_dim=head)  # V3's ratios to d_model
    cfgs = {"MLA (DeepSeek-V3 shape)": ModelConfig(**common, mla=mla),
            "GQA (2 K/V heads)": ModelConfig(**common, n_kv_heads=2)}
    print(f"device: {jax.devices()[0].device_kind}; {a.layers} layers, d_model {d}, {h} heads, "
          f"vocab {a.vocab}, float32; MLA ranks {mla}; prompt {a.prompt}, {a.new_tokens} new "
          "tokens, greedy")
    header = f"{'attention':<24} {'params':>9} {'KV B/token':>10} {'batch':>5} {'tokens/s':>9}"
    print(header)
    print("-" * len(header))
    models = {n: Transformer(c) for n, c in cfgs.items()}
    params = {n: m.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
              for n, m in models.items()}
    for batch in a.batches:
        prompts = np.random.default_rng(0).integers(0, a.vocab, (batch, a.prompt)).astype(np.int32)
        run = lambda n: lambda: generate(  # noqa: E731
            models[n], params[n], prompts, max_new_tokens=a.new_tokens, rng=jax.random.key(0),
            temperature=0.0).tokens.block_until_ready()
        times = median_times({n: run(n) for n in cfgs}, a.repeats)
        for n, sec in times.items():
            per_token = kv_cache_bytes(cfgs[n], 1, 1)
            print(f"{n:<24} {count_params(cfgs[n]):>9,} {per_token:>10,} {batch:>5} "
                  f"{batch * a.new_tokens / sec:>9,.0f}")
    mla_prefill_table(a, cfgs["MLA (DeepSeek-V3 shape)"], params["MLA (DeepSeek-V3 shape)"])


def mla_prefill_table(a, cfg, params):
    """A prompt written into an empty latent cache (its length plus --new-tokens slots), in
    the absorbed form against the cache's latents expanded: ms per prefill."""
    from jaxformer.attention.kv_cache import init_cache
    from jaxformer.model import latent_attention as mla_attention
    print(f"\nMLA prefill into the cache, ms (the absorbed form against the latents expanded; "
          f"chunks of >= {mla_attention.EXPANDED_PREFILL} tokens run expanded)")
    header = f"{'prompt':>6} {'batch':>5} {'absorbed':>9} {'expanded':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    chosen = mla_attention.EXPANDED_PREFILL
    try:
        for t in (16, 64, 256, 1024):
            for batch in a.batches:
                tokens = jnp.asarray(np.random.default_rng(0).integers(0, a.vocab, (batch, t)),
                                     jnp.int32)
                fns = {}
                for name, threshold in (("absorbed", 1 << 30), ("expanded", 2)):
                    mla_attention.EXPANDED_PREFILL = threshold  # read as the jit traces
                    fn = jax.jit(lambda p, x: Transformer(cfg).apply(  # noqa: B023
                        {"params": p}, x, cache=init_cache(cfg, batch, t + a.new_tokens))[0])
                    fn(params, tokens).block_until_ready()  # traced with this threshold
                    fns[name] = lambda fn=fn: fn(params, tokens).block_until_ready()
                times = median_times(fns, a.repeats)
                print(f"{t:>6} {batch:>5} {times['absorbed'] * 1e3:>9.1f} "
                      f"{times['expanded'] * 1e3:>9.1f} "
                      f"{times['absorbed'] / times['expanded']:>5.2f}x")
    finally:
        mla_attention.EXPANDED_PREFILL = chosen


def arguments():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="default 4, or 6 with --windowed")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--prompt", type=int, default=None, help="default 256, or 16 with --shapes"
                   " / --windowed")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--windowed", action="store_true",
                   help="a Gemma 3-shaped model: windowed against full-length KV cache")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--mla", action="store_true",
                   help="a DeepSeek-V3-shaped MLA model against GQA: cache bytes and tokens/s")
    p.add_argument("--shapes", action="store_true",
                   help="random GPT-2 shapes: cached against recompute and HF generate")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--no-repeat-ngram-size", type=int, default=0, help="--shapes: decode so")
    p.add_argument("--steps", type=int, default=300, help="training steps of target and draft")
    p.add_argument("--runs", default="runs/bench_decode", help="where they are trained")
    return p.parse_args()


def hf_gpt2(a, max_len: int):
    """HF transformers' GPT-2 of --shapes' shape in PyTorch, random weights; None without
    torch and transformers (or with --no-torch)."""
    if a.no_torch:
        return None
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=a.vocab, n_positions=max_len, n_embd=a.d_model, n_layer=a.layers,
        n_head=a.heads, activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
        pad_token_id=0)).eval()


def shape_decoders(a, model, params, recompute, hf, prompts) -> dict:
    """{name: fn()}: --shapes' decoders of `prompts`, the KV-cached one first."""
    ngram = a.no_repeat_ngram_size
    ours = lambda c: lambda: generate(  # noqa: E731
        model, params, prompts, max_new_tokens=a.new_tokens, rng=jax.random.key(0),
        temperature=0.0, constraints=c).tokens.block_until_ready()
    fns = {"jaxformer scan + KV cache": ours(None)}
    if ngram:
        fns[f"jaxformer, no repeated {ngram}-gram"] = ours(Constraints(no_repeat_ngram_size=ngram))
    else:
        fns["jitted recompute-everything loop"] = \
            lambda: recompute(params, prompts).block_until_ready()
    if hf is None:
        return fns
    import torch
    x = torch.from_numpy(prompts.astype(np.int64))

    def hf_generate(threads):
        torch.set_num_threads(threads)
        with torch.no_grad():
            hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                        max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                        no_repeat_ngram_size=ngram)
    for n in a.torch_threads:
        fns[f"HF generate, PyTorch ({n} thr)"] = functools.partial(hf_generate, n)
    return fns


def shapes_table(a):
    """--shapes: the KV-cached decoder against recomputing and HF generate, GPT-2 shapes."""
    max_len = a.prompt + a.new_tokens
    cfg = ModelConfig.from_dict({**PRESETS["gpt2-small"], "n_layers": a.layers,
                                 "d_model": a.d_model, "n_heads": a.heads,
                                 "vocab_size": a.vocab, "max_seq_len": max_len})
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    recompute = recompute_fn(model, a.new_tokens)
    hf = hf_gpt2(a, max_len)
    ngram = a.no_repeat_ngram_size
    print(f"device: {jax.devices()[0].device_kind}; GPT-2 shape: {a.layers} layers, d_model "
          f"{a.d_model}, {a.heads} heads, vocab {a.vocab}, float32; prompt {a.prompt}, "
          f"{a.new_tokens} new tokens, greedy" + (f", no {ngram}-gram twice" if ngram else ""))
    header = f"{'decoder':<36} {'batch':>5} {'seconds':>9} {'tokens/s':>10} {'vs cached':>10}"
    print(header)
    print("-" * len(header))
    for batch in a.batches:
        prompts = np.random.default_rng(0).integers(0, a.vocab, (batch, a.prompt)).astype(np.int32)
        fns = shape_decoders(a, model, params, recompute, hf, prompts)
        rows = list(median_times(fns, a.repeats).items())
        for name, sec in rows:
            tok_s = batch * a.new_tokens / sec
            print(f"{name:<36} {batch:>5} {sec:>9.3f} {tok_s:>10,.0f} {sec / rows[0][1]:>9.1f}x")
    if hf is None:
        print("(HF comparison skipped: torch and transformers not installed)")


def main():
    a = arguments()
    a.layers = a.layers or (6 if a.windowed else 4)
    if a.windowed or a.shapes or a.mla:
        a.prompt = a.prompt or 16
    if a.windowed:
        return windowed_table(a)
    if a.mla:
        a.heads = a.heads if a.heads != 4 else 8
        return mla_table(a)
    if not a.shapes:
        from decode_limit import limit_table
        a.prompt = a.prompt or 256
        return limit_table(a)
    return shapes_table(a)


if __name__ == "__main__":
    main()
