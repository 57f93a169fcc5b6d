"""Attention backends side by side: compile seconds, forward and forward+backward time,
and temporary bytes, for causal self-attention in [batch, seq, heads, head_dim] layout,
each handed the mask as the model hands it: a jaxformer.attention.masks.MaskRule by index
(jaxformer.attention.backends.rule_attention), which blockwise and splash read a block at a time,
xla and cudnn as is_causal, and reference and chunked as the rule's mask array.

    python bench/attention.py [--batch 4] [--seq 512 1024] [--heads 8] [--kv-heads 8 2]
        [--head-dim 64] [--dtype float32] [--impls reference xla chunked blockwise]
        [--repeats 20]
        [--chunk 128 ...]

splash runs in Pallas interpret mode off TPUs: its times there measure the interpreter.

--chunk sets the chunked backend's query rows per causal block (one row per value).

--context N splits the sequence over N devices (a (1, 1, 1, N) mesh; --devices N fakes them
on a CPU), in zigzag order, for the backends that split it: --impls ring all_gather. On
fake devices every device's work shares the host's cores, so read the times against each
other, not as one device's.

Prints a table; asserts nothing about speed. Timings are medians over --repeats calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--devices" in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
        f" --xla_force_host_platform_device_count={sys.argv[sys.argv.index('--devices') + 1]}"

import jax
import jax.numpy as jnp

from jaxformer.attention import chunked, resolve_impl, rule_attention
from jaxformer.attention.masks import MaskRule
from jaxformer.attention.ring import zigzag_order
from jaxformer.core.sharding import make_mesh, resolve_rules, sharding_context


# the backends whose block size --chunk sweeps: (module, attribute), read when traced
SWEPT = {"chunked": (chunked, "CHUNK")}


def timed(fn, *args, repeats):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else float("nan")
    return compile_s, statistics.median(times), temp


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--impls", nargs="+", default=["reference", "xla", "chunked", "blockwise"])
    p.add_argument("--chunk", type=int, nargs="+", default=[chunked.CHUNK])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--context", type=int, default=1)
    p.add_argument("--devices", type=int, default=None)
    a = p.parse_args()
    mesh = make_mesh(1, 1, 1, a.context, devices=jax.devices()[:a.context])

    dtype = jnp.dtype(a.dtype)
    print(f"backend={jax.default_backend()} devices={jax.device_count()} dtype={a.dtype} "
          f"batch={a.batch} heads={a.heads} head_dim={a.head_dim}; auto -> "
          f"{resolve_impl('auto', dtype, a.head_dim)}")
    header = (f"{'impl':>14} {'seq':>6} {'kv':>3} {'compile s':>10} {'fwd ms':>9} "
              f"{'fwd+bwd ms':>11} {'fwd Mtok/s':>11} {'fwd+bwd temp MiB':>17}")
    print(header)
    print("-" * len(header))
    for seq in a.seq:
        for kv in a.kv_heads:
            keys = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(keys[0], (a.batch, seq, a.heads, a.head_dim), dtype)
            k = jax.random.normal(keys[1], (a.batch, seq, kv, a.head_dim), dtype)
            v = jax.random.normal(keys[2], (a.batch, seq, kv, a.head_dim), dtype)
            pos = jnp.broadcast_to(jnp.arange(seq), (a.batch, seq))
            rule = MaskRule(pos, pos, is_causal=True, by_index=True)
            if a.context > 1:  # positions carry causality in zigzag order
                pos = jnp.broadcast_to(jnp.asarray(zigzag_order(seq, a.context)), pos.shape)
                rule = MaskRule(pos, pos)
            runs = [(impl, c) for impl in a.impls for c in (a.chunk if impl in SWEPT else [None])]
            for impl, chunk in runs:
                if chunk is not None:
                    setattr(*SWEPT[impl], chunk)  # read when traced
                name = impl if chunk is None else f"{impl}/{chunk}"

                def fwd(q, k, v, rule, impl=impl):
                    with sharding_context(mesh, resolve_rules()):
                        return rule_attention(q, k, v, rule, impl=impl)

                def fwd_bwd(q, k, v, rule, fwd=fwd):
                    return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, rule).astype(
                        jnp.float32)), argnums=(0, 1, 2))(q, k, v)

                c_s, f_s, _ = timed(fwd, q, k, v, rule, repeats=a.repeats)
                _, fb_s, temp = timed(fwd_bwd, q, k, v, rule, repeats=a.repeats)
                print(f"{name:>14} {seq:>6} {kv:>3} {c_s:>10.2f} {f_s * 1e3:>9.2f} "
                      f"{fb_s * 1e3:>11.2f} {a.batch * seq / f_s / 1e6:>11.3f} "
                      f"{temp / 2**20:>17.1f}")


if __name__ == "__main__":
    main()
