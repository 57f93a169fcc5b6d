"""Section 7: the chunked loss at a large vocabulary: configs/gpu_1b.yaml's train step (bf16
compute, float32 params, scanned, remat dots) at vocab sizes.chunk_vocab (152,064: Qwen2.5's)
and T sizes.chunk_seq (4,096), batch sizes.chunk_batch, at each model.loss_chunk of
sizes.loss_chunks (0: the plain loss holding the [B, T, V] logits; N: the head and loss
over blocks of N positions, jaxformer.training.chunked_loss): the step's peak memory as the
compiler sizes it (arguments + temporaries + unaliased outputs: bench/memory.py's count),
tokens/s and the loss (one batch repeated: it says the two agree, not that they learn). A
step past 90% of device memory is compiled and sized but not run."""

from __future__ import annotations

import dataclasses

from gpu_suite.sizes import GIB, Sizes, swept
from gpu_suite.train_step import (batch_of, compile_step, device_bytes_limit,
                                  seconds_per_step, step_bytes, train_models)
from jaxformer import Transformer, count_params
from jaxformer.training.chunked_loss import ChunkedLanguageModel
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step


def chunk_row(cfg, seq: int, chunk: int, sizes: Sizes) -> dict:
    model = Transformer(cfg)
    tx, schedule = make_optimizer(OptimConfig(), cfg, 1000)
    objective = ChunkedLanguageModel(1, chunk) if chunk else None
    step = make_train_step(model, tx, schedule, objective=objective)
    state = init_state(model, tx, 0)
    batch = sizes.chunk_batch
    compiled, compile_s = compile_step(step, state, cfg, batch, seq)
    peak, limit = step_bytes(compiled), device_bytes_limit()
    row = {"vocab": cfg.vocab_size, "params": count_params(cfg), "seq": seq, "batch": batch,
           "chunk": chunk, "step_gib_compiled": (peak or float("nan")) / GIB,
           "logits_gib": batch * seq * cfg.vocab_size * 4 / GIB, "compile_s": compile_s,
           "tokens_per_s": None, "loss": None}
    if limit is None or peak is None or peak <= 0.9 * limit:
        seconds, metrics = seconds_per_step(compiled, state, batch_of(cfg, batch, seq),
                                            sizes.steps)
        row.update(step_ms=seconds * 1e3, tokens_per_s=batch * seq / seconds,
                   loss=float(metrics["loss"]))
    return row


def chunk_rows(sizes: Sizes) -> list[dict]:
    """One row per model.loss_chunk; peak_of_plain: the step's peak over the plain loss's."""
    name, cfg, _ = train_models(sizes)[1]
    seq = sizes.chunk_seq
    cfg = dataclasses.replace(cfg, vocab_size=sizes.chunk_vocab, max_seq_len=seq, remat="dots")
    return swept("loss_chunk", "chunk", sizes.loss_chunks,
                 lambda chunk: chunk_row(cfg, seq, chunk, sizes), {"model": name},
                 ("step_gib_compiled", "peak_of_plain"))
