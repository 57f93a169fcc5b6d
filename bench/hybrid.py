"""Hybrid models (recurrent layers beside attention): the train step of a Qwen3-Next-shaped
and a Nemotron-H-shaped model against transformers' eager PyTorch on the same weights, then
decoding as the prompt grows and each model's cache bytes per token.

    python bench/hybrid.py [--shapes qwen3_next,nemotron_h --layers 4 --d-model 256
        --seq 512 --batch 4 --vocab 256 --steps 3 --lengths 256,1024,4096,8192
        --batches 1,8 --new-tokens 32 --repeats 5 --no-torch --no-train --no-decode --smoke]

Train: transformers' model is built from a random config (its matrices redrawn at std 0.1,
so that every layer shows in the logits), saved with save_pretrained and read by
jaxformer.convert.from_hf, so both run the same model; one forward's logits are compared
first. qwen3_next: 3 gated delta layers to 1 gated attention
layer, a dense SwiGLU MLP in every layer (mlp_only_layers: all), Qwen3-Next's proportions
(value heads 2 x d_model wide, key heads half that, GQA attention with 2 K/V heads);
transformers runs its torch fallbacks (torch_chunk_gated_delta_rule, chunk 64; the causal
conv as F.conv1d). nemotron_h: Mamba-2, attention (NoPE) and squared-ReLU MLP layers, one
sublayer each, in Nemotron-H's order; transformers runs Mamba-2's torch path (the chunked
SSD in einsums, chunk_size 128, as ours). Both take an AdamW step with the gradient clipped
to norm 1, float32, attention in transformers' default (sdpa). The two implementations take
turns step by step (bench/train_throughput.py's interleaving); times are medians, "first s"
is the first step (tracing and compiling for ours).

Decode: greedy steps at batch 1 and 8 after a prompt of each --lengths: the cache a prompt
of that length leaves (its slots' positions filled; keys, values and states zeros: a step's
work does not depend on them; no prefill is timed), then --new-tokens of generate's steps
(jaxformer.decode.cached_forward.forward_one, the argmax fed back) in one jitted lax.scan,
the cache donated; the least of --repeats runs, the lengths taking turns (a shared
machine's noise only adds). Five
models of equal width and depth: attention only, the gated delta hybrid, gated delta only,
the Nemotron-H hybrid and Mamba-2 only (every layer a Mamba-2 mixer, no MLP). Cache bytes
per token: jaxformer.attention.kv_cache.kv_cache_bytes at batch 1 over the length. Prints
tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import bench_jax, bench_torch, interleaved, timed  # noqa: E402

from jaxformer import Transformer, count_params  # noqa: E402
from jaxformer.attention.kv_cache import init_cache, kv_cache_bytes, rolled_back  # noqa: E402
from jaxformer.convert import config_from_hf, from_hf  # noqa: E402
from jaxformer.decode.cached_forward import CPU_DECODE_OPTIONS, forward_one, looped  # noqa: E402
from jaxformer.model.mixers import MIXERS  # noqa: E402

LINEAR, FULL, MLP = "linear_attention", "full_attention", "mlp"
# Nemotron-H 8B's order of sublayers (Mamba-2 M, MLP -, attention *), cut to --layers
NEMOTRON_ORDER = [LINEAR, MLP, LINEAR, FULL, MLP, LINEAR, MLP, LINEAR, MLP, LINEAR, FULL, MLP]


def qwen3_next_keys(a, types=None) -> dict:
    """Qwen3-Next's config.json at the command line's sizes: 3 gated delta : 1 attention."""
    d, n = a.d_model, a.layers
    return dict(model_type="qwen3_next", vocab_size=a.vocab, hidden_size=d,
                intermediate_size=3 * d, num_hidden_layers=n, num_attention_heads=d // 64,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=a.max_len,
                linear_num_value_heads=2 * d // 64, linear_num_key_heads=d // 64,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                layer_types=types or [FULL if i % 4 == 3 else LINEAR for i in range(n)],
                mlp_only_layers=list(range(n)), num_experts=0, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def nemotron_h_keys(a, types=None) -> dict:
    """Nemotron-H's config.json at the command line's sizes (Mamba-2 heads 2 x d_model wide,
    2 groups of state 64; attention with 2 K/V heads; MLP 4 x d_model)."""
    d = a.d_model
    return dict(model_type="nemotron_h", vocab_size=a.vocab, hidden_size=d,
                intermediate_size=4 * d, num_attention_heads=d // 64, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=a.max_len,
                layers_block_type=types or (NEMOTRON_ORDER * a.layers)[:a.layers],
                mamba_num_heads=2 * d // 64, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
                conv_kernel=4, chunk_size=128, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


SHAPES = {"qwen3_next": (qwen3_next_keys, "Qwen3NextForCausalLM"),
          "nemotron_h": (nemotron_h_keys, "NemotronHForCausalLM")}
# decode's models: (name, its ModelConfig of the arguments), equal width and depth; gated
# delta alone is the hybrid's config with every layer its linear kind (and no RoPE: no layer
# attends)
DECODE_MODELS = (
    ("attention", lambda a: config_from_hf(qwen3_next_keys(a, [FULL] * a.layers))),
    ("gated delta 3:1 attention", lambda a: config_from_hf(qwen3_next_keys(a))),
    ("gated delta", lambda a: config_from_hf(qwen3_next_keys(a)).replace(
        layer_pattern=("linear",), layer_kinds={"linear": {"mixer": "gated_delta"}},
        position="none", rope_fraction=1.0)),
    ("Nemotron-H (Mamba-2, attn, MLP)", lambda a: config_from_hf(nemotron_h_keys(a))),
    ("Mamba-2", lambda a: config_from_hf(nemotron_h_keys(a, [LINEAR] * a.layers))),
)


def converted(shape: str, a, folder: str):
    """(transformers' model, our config, our params) of one shape: a random HF model saved
    with save_pretrained and read back by from_hf."""
    import torch
    import transformers as T
    keys = dict(SHAPES[shape][0](a))
    config = T.AutoConfig.for_model(keys.pop("model_type"), **keys)
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every matrix at std 0.1: each layer shows in the logits
        for p in hf.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    cfg, params = from_hf(folder)
    return hf, cfg, params


def logits_error(hf, cfg, params, vocab: int) -> float:
    """max |ours - transformers| / max |transformers| of one forward over 256 tokens."""
    import torch
    tokens = np.random.default_rng(1).integers(0, vocab, (1, 256))
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(Transformer(cfg).apply({"params": params}, jnp.asarray(tokens)))
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def layer_counts(cfg) -> str:
    """e.g. "3 gated_delta + 1 attention" from the layers' mixers (a layer of its FFN
    alone: "ffn")."""
    names = [m if MIXERS[m].mixes else "ffn" for m in cfg.layer_mixers]
    return " + ".join(f"{names.count(m)} {m}" for m in dict.fromkeys(names))


def train_table(a, shape: str):
    """One shape's train step, ours against transformers', interleaved."""
    with tempfile.TemporaryDirectory() as folder:
        hf, cfg, params = converted(shape, a, folder)
    err = logits_error(hf, cfg, params, a.vocab)
    print(f"[{shape}] {layer_counts(cfg)} layers, d_model {cfg.d_model}, "
          f"{count_params(cfg):,} params; batch {a.batch} x seq {a.seq}; logits of one "
          f"forward agree to {err:.1e} relative")
    first, one = bench_jax(cfg, a.batch, a.seq, params)
    rows, runners = [["jaxformer (jit)", first]], [one]
    if not a.no_torch:
        res = bench_torch(shape, cfg, a.batch, a.seq, build=lambda: hf)
        rows.append([f"HF {SHAPES[shape][1]}, eager ({res[2]} thr)", res[0]])
        runners.append(res[1])
    for row, med in zip(rows, interleaved(runners, a.steps)):
        row.extend(med)
    header = (f"| {'implementation':<40} | first s | fwd ms | fwd+bwd ms | step ms "
              f"| tokens/s |")
    print(header + "\n|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, first_s, fwd, fwd_bwd, step in rows:
        print(f"| {name:<40} | {first_s:7.1f} | {fwd:6.0f} | {fwd_bwd:10.0f} | {step:7.0f} | "
              f"{a.batch * a.seq / step * 1e3:8,.0f} |")
    if len(rows) > 1:
        print(f"jaxformer / transformers tokens/s: {rows[1][-1] / rows[0][-1]:.2f}x")
    print()


def prompt_cache(cfg, batch: int, prompt: int, new: int):
    """The cache a prompt of `prompt` tokens leaves, with room for `new` more: its slots'
    positions 0 .. prompt - 1, its keys, values and recurrent states zeros."""
    cache = init_cache(cfg, batch, prompt + new)
    slots = jnp.broadcast_to(jnp.arange(prompt + new, dtype=jnp.int32),
                             cache["positions"].shape)  # [B, S]
    return rolled_back(dict(cache, positions=slots), prompt)


def decoder(cfg, new: int):
    """run(params, cache, tokens [B], positions [B]) -> (tokens [B], cache): `new` greedy
    steps (generate's: forward_one, then the argmax fed back) in one jitted lax.scan, the
    cache donated and updated in place."""
    model, _ = looped(cfg)

    def run(params, cache, tokens, positions):
        def step(carry, _):
            cache, tok, pos = carry
            logits, cache = forward_one(model, params, tok, pos, cache)  # [B, V]
            return (cache, jnp.argmax(logits, -1).astype(jnp.int32), pos + 1), None

        (cache, tokens, _), _ = jax.lax.scan(step, (cache, tokens, positions), None, new)
        return tokens, cache

    options = CPU_DECODE_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(run, donate_argnums=1, compiler_options=options)


def step_ms(cfg, params, batch: int, a) -> list[float]:
    """ms per greedy step after a prompt of each of --lengths: the least of --repeats runs
    of --new-tokens steps (after one to compile), the lengths taking turns run by run, each
    run from a fresh cache (a shared machine's noise only ever adds)."""
    tokens = jnp.zeros((batch,), jnp.int32)
    runs = {n: (decoder(cfg, a.new_tokens), jnp.full((batch,), n, jnp.int32))
            for n in a.lengths}
    times = {n: [] for n in a.lengths}
    for _ in range(a.repeats + 1):
        for n, (run, positions) in runs.items():
            cache = jax.block_until_ready(prompt_cache(cfg, batch, n, a.new_tokens))
            times[n].append(timed(lambda c=cache, r=run, p=positions: jax.block_until_ready(
                r(params, c, tokens, p))))
    return [min(times[n][1:]) / a.new_tokens for n in a.lengths]


def decode_tables(a):
    """Greedy step time and tokens/s by prompt length and batch, then cache bytes per
    token, for each of DECODE_MODELS."""
    lengths = a.lengths
    rows, sizes = [], []
    for name, model_config in DECODE_MODELS:
        cfg = model_config(a)
        params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        sizes.append((name, f"{layer_counts(cfg)}; {count_params(cfg) / 1e6:.1f}M params",
                      [kv_cache_bytes(cfg, 1, n) / n for n in lengths]))
        for b in a.batches:
            ms = step_ms(cfg, params, b, a)
            rows.append((name, b, ms))
            print(f"  {name}, batch {b}: " + ", ".join(f"{m:.2f}" for m in ms) + " ms",
                  file=sys.stderr, flush=True)
    print(f"Greedy decode, ms per step (tokens/s) after a prompt of n tokens; "
          f"{a.new_tokens} steps per run, the least of {a.repeats} runs")
    print("| model | batch | " + " | ".join(f"n={n:,}" for n in lengths)
          + f" | step {lengths[-1]:,} / {lengths[0]:,} |")
    print("|---|---|" + "---|" * len(lengths) + "---|")
    for name, b, ms in rows:
        cells = " | ".join(f"{m:.2f} ({b / m * 1e3:,.0f})" for m in ms)
        print(f"| {name} | {b} | {cells} | {ms[-1] / ms[0]:.2f}x |")
    print("\nCache bytes per token (kv_cache_bytes at batch 1 / n; float32)")
    print("| model | layers | " + " | ".join(f"n={n:,}" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for name, layers, per_token in sizes:
        print(f"| {name} | {layers} | " + " | ".join(f"{x:,.0f}" for x in per_token) + " |")


SMOKE = dict(layers=4, d_model=128, seq=64, batch=2, vocab=64, steps=1, lengths=[16, 64],
             batches=[1, 2], new_tokens=4, repeats=1)


def arguments():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: "
                   + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256, help="a multiple of 64")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed train steps (median)")
    p.add_argument("--lengths", default="256,1024,4096,8192", help="decode's prompt lengths")
    p.add_argument("--batches", default="1,8", help="decode's batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per decode run")
    p.add_argument("--repeats", type=int, default=5, help="decode runs (the least)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: seconds")
    a = p.parse_args()
    a.lengths = [int(n) for n in a.lengths.split(",")]
    a.batches = [int(n) for n in a.batches.split(",")]
    if a.smoke:
        vars(a).update(SMOKE)
    a.shapes = [s.strip() for s in a.shapes.split(",")]
    if set(a.shapes) - set(SHAPES):
        p.error(f"unknown shape(s) {', '.join(sorted(set(a.shapes) - set(SHAPES)))}; "
                f"shapes are: {', '.join(SHAPES)}")
    a.max_len = max(a.seq, max(a.lengths) + a.new_tokens)
    return a


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the device's kind."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]} x{len(names)}" if names else jax.devices()[0].device_kind


def main():
    a = arguments()
    print(f"device: {cpu_name()} ({jax.default_backend()}); float32\n")
    if not a.no_train:
        for shape in a.shapes:
            train_table(a, shape)
    if not a.no_decode:
        decode_tables(a)


if __name__ == "__main__":
    main()
