"""Batch-1 generation at the memory limit (bench/decode.py's default table): float32,
bfloat16 and int8 weights, each plain, with prompt lookup and with a draft model a quarter
the size, on Python source; beside Hugging Face's generate and assisted generation on the
same weights.

A target (8 layers, d_model 512) and a draft (2 layers, the same width: a quarter of the
target's block weights) are trained on the default corpus (the standard library's source)
the first time, into --runs (default runs/bench_decode), and reused after. The prompt is
the first --prompt bytes of a standard-library file; greedy, --new-tokens tokens.

Columns: tokens/s (median over rounds, every decoder once per round, interleaved);
bytes read per token (weights, less the learned position table, of which a token reads
one row, plus the mean KV cache; speculative: the model's weights once per round and the
draft's once per draft token, over the tokens); the weight-read roofline is the bytes per
token of plain decoding in that format over the read bandwidth of a float32 array of the
float32 weights' size (jnp.sum, measured in the same rounds), and "% of roofline" is
tokens/s against it (above 100%: fewer weight reads per token than one each); acceptance:
drafted tokens kept. "same" says whether the tokens are jaxformer float32 plain greedy's.
"""

from __future__ import annotations

import pathlib
import statistics
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode import generate
from jaxformer.model.quantize import quantize, weight_bytes

TARGET = ["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.max_seq_len=1024"]
DRAFT = ["model.d_model=512", "model.n_layers=2", "model.n_heads=8", "model.max_seq_len=1024"]


def trained(run_dir: pathlib.Path, overrides, steps: int):
    """(model, params, tokenizer) of a run trained on the default corpus (trained now
    unless run_dir holds its last checkpoint)."""
    from jaxformer.training.saved_run import load_run
    from jaxformer.training import train
    from jaxformer.training.config import load_config
    if not (run_dir / "checkpoints" / str(steps)).is_dir():
        cfg = load_config("configs/tiny.yaml", overrides + [
            f"train.steps={steps}", f"train.run_dir={run_dir}", "train.batch_size=8",
            f"checkpoint.every={steps}", f"train.eval_every={steps}"])
        print(f"training {run_dir} ({steps} steps)", flush=True)
        train(cfg, log=lambda *args, **kw: None)
    return load_run(str(run_dir))


def code_prompt(tok, width: int) -> np.ndarray:
    text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    return np.asarray(tok.encode(text)[:width], np.int32)[None]


def stream_bytes(cfg, params, tokens: int, prompt: int) -> int:
    """Bytes one plain decode step reads: the weights (less the learned position table)
    and the KV cache at its mean length."""
    pos = params.get("pos_embed", {}).get("embedding")
    w = weight_bytes(params) - (0 if pos is None else pos.size * pos.dtype.itemsize)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * (prompt + tokens / 2)
    return int(w + kv)


def hf_decoders(target, draft, prompt, a):
    """{name: fn() -> new tokens [N]} for transformers' generate on the same weights
    (converted with jaxformer.convert.to_hf), or {} without torch / transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("(Hugging Face rows skipped: torch and transformers not installed)")
        return {}
    from jaxformer.convert import to_hf
    torch.set_num_threads(a.torch_threads[0])
    models = []
    for model, params in (target, draft):
        folder = tempfile.mkdtemp(prefix="jaxformer_decode_")
        to_hf(model.cfg, params, folder)
        models.append(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    x = torch.from_numpy(prompt.astype(np.int64))

    def run(**kw):
        def fn():
            with torch.no_grad():
                out = models[0].generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                         max_new_tokens=a.new_tokens,
                                         min_new_tokens=a.new_tokens, pad_token_id=0, **kw)
            return out[0, x.shape[1]:].numpy()
        return fn
    t = f"{a.torch_threads[0]} thr"
    return {f"HF generate ({t})": run(),
            f"HF prompt lookup, k={a.draft_len} ({t})": run(prompt_lookup_num_tokens=a.draft_len),
            f"HF assisted, draft model ({t})": run(assistant_model=models[1])}


def jaxformer_decoders(target, draft, prompt, a):
    """{name: (fn() -> Generated, weights format, draft kind)} for every format x draft."""
    rows = {}
    for w in ("float32", "bfloat16", "int8"):
        params, dparams = quantize(target[1], w), quantize(draft[1], w)
        for kind, d in (("none", None), ("prompt lookup", "prompt_lookup"),
                        ("draft model", (draft[0], dparams))):
            def fn(params=params, d=d):
                out = generate(target[0], params, prompt, max_new_tokens=a.new_tokens,
                               rng=jax.random.key(0), temperature=0.0, draft=d,
                               draft_len=a.draft_len)
                return jax.block_until_ready(out)
            rows[f"jaxformer {w}, {kind}"] = (fn, w, kind)
    return rows


def timed_rounds(fns, rounds: int):
    """{name: (median seconds, last output)}: each fn once to warm up, then once a round."""
    outs = {name: fn() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), outs[name]) for name, t in times.items()}


def cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return jax.devices()[0].device_kind


def limit_table(a):
    runs = pathlib.Path(a.runs)
    tm, tp, tok = trained(runs / "target", TARGET, a.steps)
    dm, dp, _ = trained(runs / "draft", DRAFT, a.steps)
    prompt, n = code_prompt(tok, a.prompt), a.new_tokens
    ours = jaxformer_decoders((tm, tp), (dm, dp), prompt, a)
    f32_bytes = weight_bytes(tp)
    x, total = jnp.ones(f32_bytes // 4, jnp.float32), jax.jit(jnp.sum)
    fns = {"read": lambda: total(x).block_until_ready()}
    fns.update({name: f for name, (f, _, _) in ours.items()})
    fns.update(hf_decoders((tm, tp), (dm, dp), prompt, a))
    results = timed_rounds(fns, a.repeats)
    bandwidth = f32_bytes / results.pop("read")[0]
    print(f"CPU: {cpu_name()}; target {f32_bytes / 1e6:.1f} MB float32 ({tm.cfg.n_layers} "
          f"layers, d_model {tm.cfg.d_model}), draft {weight_bytes(dp) / 1e6:.1f} MB "
          f"({dm.cfg.n_layers} layers); prompt: {prompt.shape[1]} bytes of textwrap.py, {n} "
          f"new tokens, greedy, batch 1, k={a.draft_len}; float32 read {bandwidth / 1e9:.1f} GB/s")
    header = (f"{'decoder':<40} {'tokens/s':>9} {'MB/token':>9} {'roofline':>9} "
              f"{'% of it':>8} {'accept':>7} {'vs plain':>9} {'same':>5}")
    print(header + "\n" + "-" * len(header))
    want = np.asarray(results["jaxformer float32, none"][1].tokens[0])
    step = {w: stream_bytes(tm.cfg, quantize(tp, w), n, prompt.shape[1]) for w in
            ("float32", "bfloat16", "int8")}
    dstep = {w: stream_bytes(dm.cfg, quantize(dp, w), n, prompt.shape[1]) for w in step}
    hf_plain = next((sec for name, (sec, _) in results.items() if name.startswith("HF gen")), 1)
    for name, (sec, out) in results.items():
        _, w, kind = ours.get(name, (None, "float32", "hf"))
        base = results[f"jaxformer {w}, none"][0] if kind != "hf" else hf_plain
        tokens, per_token, accept = (out, None, "-") if kind == "hf" else \
            (np.asarray(out.tokens[0]), step[w], "-")
        if name.startswith("HF gen"):
            per_token = step[w]
        if kind in ("prompt lookup", "draft model"):
            rounds = int(out.drafted[0]) / a.draft_len
            reads = step[w] + (dstep[w] * a.draft_len if kind == "draft model" else 0)
            per_token, accept = rounds * reads / n, f"{out.acceptance_rate:.2f}"
        roof = bandwidth / step[w]
        mb = "-" if per_token is None else f"{per_token / 1e6:.1f}"
        print(f"{name:<40} {n / sec:>9,.1f} {mb:>9} {roof:>9,.1f} {100 * n / sec / roof:>7.0f}% "
              f"{accept:>7} {base / sec:>8.2f}x {'yes' if np.array_equal(tokens, want) else 'no':>5}")
