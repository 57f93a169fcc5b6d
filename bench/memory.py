"""Per-device memory of a run's train step on a mesh, before launching it: the step is
lowered and compiled for abstract inputs (nothing is allocated) and XLA's memory analysis
printed for each mesh asked for.

    python bench/memory.py configs/gpt2_small.yaml --devices 8 \
        --mesh 8,1,1 --mesh 1,8,1 --mesh 2,2,2 --mesh 1,1,1,8 [section.key=value ...]

A mesh is data,fsdp,tensor[,context]; one of fewer devices than there are runs on the
first ones (1,1,1,1: the whole sequence on one device).

--loss-chunk N (repeatable) prints a row for each model.loss_chunk (0: the plain loss; N:
the head and loss over blocks of N positions, jaxformer.training.chunked_loss), e.g. the
peak at a 152k vocabulary and T 4,096 (docs/performance.md, "The loss at a large vocabulary"):

    python bench/memory.py configs/tiny.yaml --loss-chunk 0 --loss-chunk 512 \
        model.vocab_size=152064 model.d_model=512 model.n_heads=8 model.max_seq_len=4096 \
        train.seq_len=4096 train.batch_size=4 optim.grad_accum=1

An encoder-decoder's config (configs/transformer_base.yaml) is sized with its seq2seq
batch: source and target of train.seq_len each.

--devices fakes that many CPU devices, so a GPU or TPU mesh can be sized on a laptop: the
bytes are the compiler's for CPU, close to but not exactly a GPU's (fusion and layouts
differ). On the target machine itself leave --devices out. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default="configs/tiny.yaml")
    ap.add_argument("--devices", type=int, default=None, help="fake this many CPU devices")
    ap.add_argument("--mesh", action="append", default=None,
                    help="data,fsdp,tensor[,context] (repeatable; default: the config's mesh)")
    ap.add_argument("--loss-chunk", type=int, action="append", default=None,
                    help="model.loss_chunk (repeatable; default: the config's)")
    args, overrides = ap.parse_known_args(argv)
    if args.devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp

    from jaxformer import count_params, model_for
    from jaxformer.core.sharding import (batch_sharding, check_context_split, make_mesh,
                                         resolve_rules)
    from jaxformer.data import seq2seq
    from jaxformer.model.archs import ARCHS
    from jaxformer.training import load_config, objectives
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import abstract_state, make_train_step, state_shardings

    cfg = load_config(args.config, overrides)
    model = model_for(cfg.model)
    ints = seq2seq.ARRAYS if ARCHS[cfg.model.arch].cross_attention else ("inputs", "targets")
    tx, schedule = make_optimizer(cfg.optim, cfg.model, cfg.train.steps)
    rules = resolve_rules(cfg.mesh.rules)
    meshes = [tuple(int(s) for s in m.split(",")) for m in args.mesh] if args.mesh else \
        [(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.context)]
    b, t = cfg.train.batch_size, cfg.train.seq_len
    print(f"{args.config}: {count_params(cfg.model) / 1e6:,.1f}M params, batch {b} x {t}, "
          f"{cfg.model.dtype} compute, {cfg.model.param_dtype} params, remat={cfg.model.remat}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"vocab {cfg.model.vocab_size:,}, d_model {cfg.model.d_model}, "
          f"{cfg.model.n_layers} layers, grad_accum {cfg.optim.grad_accum}")
    print("| mesh (data, fsdp, tensor, context) | attention | loss chunk | arguments GiB | "
          "outputs GiB | temporaries GiB | peak GiB / device | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    chunks = args.loss_chunk or [cfg.train.loss_chunk]
    for shape, chunk in ((s, c) for s in meshes for c in chunks):
        run = load_config(args.config, [*overrides, f"model.loss_chunk={chunk}"])
        n = math.prod(s for s in shape if s > 0)
        mesh = make_mesh(*shape, devices=jax.devices()[:n] if -1 not in shape else None)
        check_context_split(t, mesh.shape["context"])
        shardings = state_shardings(model, tx, mesh, rules)
        abstract = abstract_state(model, tx)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             abstract, shardings)
        bs = batch_sharding(mesh, rules)
        batch = {k: jax.ShapeDtypeStruct((b, t), dtype, sharding=bs) for k, dtype in
                 (*((k, jnp.int32) for k in ints), ("loss_mask", jnp.float32))}
        step = make_train_step(model, tx, schedule, grad_accum=cfg.optim.grad_accum, mesh=mesh,
                               rules=rules, shardings=shardings, objective=objectives.build(run))
        row = compiled_row(step, state, batch)
        print(f"| {shape} | {cfg.model.attention_impl} | {chunk} | {row}")


def compiled_row(step, state, batch) -> str:
    """The table's byte and time cells for the step compiled on abstract inputs."""
    gib, t0 = 2**30, time.perf_counter()
    m = step.lower(state, batch).compile().memory_analysis()
    seconds = time.perf_counter() - t0
    # donated state: outputs alias the arguments, so the peak is args + temps (+ any
    # output that is not an alias)
    peak = m.argument_size_in_bytes + m.temp_size_in_bytes + \
        max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
    return (f"{m.argument_size_in_bytes / gib:.3f} | {m.output_size_in_bytes / gib:.3f} | "
            f"{m.temp_size_in_bytes / gib:.3f} | {peak / gib:.3f} | {seconds:.1f} |")

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
