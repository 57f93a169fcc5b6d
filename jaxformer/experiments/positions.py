"""The positional-encoding study: one model per scheme on the same data, seed, token budget
and architecture (only the positional part differs), trained at length L, then scored on
the validation split at L, 2L, ... 32L.

    python -m jaxformer.experiments.positions [configs/experiments/positions.yaml]
        [--seeds N] [--out DIR] [--small] [section.key=value ...]

Sections: study.* (StudySettings), model.* (ModelConfig fields, or model.preset; not
position, rope_scaling or max_seq_len, which the study sets), data.*, optim.*, and
train.steps / batch_size / seq_len (= L) / seed / log_every / random_positions (MAX:
train on sorted random positions from [0, MAX), Ruoss et al. 2023; evaluate on 0..n-1).

Evaluation: the first N validation tokens (the same ones at every length) are cut into
non-overlapping windows of n*L tokens; every token of every window is scored, with the
tokens before it in its window as its context, and the perplexity is exp(mean negative
log-likelihood per token). Longer windows give later tokens more context, so a scheme
that extrapolates has a *lower* perplexity at 32L than at L. With model.attention_impl
auto, a length whose dense logits would pass DENSE_LOGITS_BYTES runs blockwise attention
(memory linear in the length). "rope+yarn" (study.rope_scaling) is the trained RoPE model
evaluated at n*L with rope_scaling = {kind, factor: n, original_max_seq_len: L}: nothing
is retrained. The learned table has L rows, so learned positions have no score beyond L
(null in results.json, "n/a" in the table).

Columns (study.schemes) are position schemes on the run's model, or model variants
(positions_config.MODEL_VARIANTS: hybrid-rope = 3 gated DeltaNet layers : 1 attention
layer with RoPE, pure gated_delta or mamba2 without positions, ...), each a table entry
owning its layer pattern and mixers; every other setting is the run's.
"""

from __future__ import annotations

import functools
import math
import sys
import time

import jax
import numpy as np

from jaxformer.core.sharding import make_mesh, param_shardings, resolve_rules
from jaxformer.data import DataError, get_batch, load_dataset
from jaxformer.data.random_positions import randomize_batch
from jaxformer.experiments.positions_config import (DEFAULT_CONFIG, SMALL, StudyConfig,
                                                    StudySettings, column_fields,
                                                    load_study_config, multiples_of_l,
                                                    study_main)
from jaxformer.experiments.report import summarize, write_outputs
from jaxformer.experiments.seeds import seed_slice, train_seeds
from jaxformer.model.build import count_params
from jaxformer.model.config import ConfigError, ModelConfig, RopeScaling
from jaxformer.model.transformer import Transformer
from jaxformer.training.step import make_eval_step

__all__ = ["DEFAULT_CONFIG", "SMALL", "StudyConfig", "StudySettings", "eval_config",
           "load_study_config", "main", "perplexity", "run_study", "train_models"]


# ---- training and evaluation ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _evaluator(mcfg: ModelConfig, context: int = 1, objective=None):
    """The jitted eval step; context > 1: with each sequence split over that many devices
    (context parallelism: lengths past one device's memory), the params replicated.
    objective: None (next-token loss) or MLM's (jaxformer.training.mlm.MaskedLM)."""
    model = Transformer(mcfg)
    if context == 1:
        return make_eval_step(model, objective=objective)
    mesh, rules = make_mesh(1, 1, 1, context, devices=jax.devices()[:context]), resolve_rules()
    return make_eval_step(model, mesh=mesh, rules=rules, objective=objective,
                          param_shardings=param_shardings(model, mesh, rules))


def train_models(cfg: StudyConfig, mcfg: ModelConfig, train_tokens, seeds, log, objective=None):
    """(params stacked over the seeds, each seed's mean train loss over the last log_every
    steps) after train.steps steps: the seeds trained at once, as one vmapped program.
    objective: the study's (StudyConfig.objective; None: the LM loss)."""
    t = cfg.run.train

    def batch(seed, step):
        rows = get_batch(train_tokens, None, seed=seed, step=step, batch_size=t.batch_size,
                         seq_len=t.seq_len)
        return randomize_batch(rows, t.random_positions, seed, step)  # Ruoss et al., or none

    return train_seeds(mcfg, cfg.run.optim, t.steps, seeds, batch, log_every=t.log_every,
                       log=log, objective=objective)


def perplexity(mcfg: ModelConfig, params, tokens, length: int,
               batch_tokens: int, context: int = 1, objective=None) -> float | None:
    """exp(mean next-token NLL) over tokens[1:], the tokens cut into windows of `length`;
    with the MLM objective (an encoder), exp(mean NLL of the masked tokens), each window
    corrupted as MLM's evaluation does (jaxformer.training.mlm).

    tokens: [n * length + 1] ints; each window is scored with no context from before it.
    context: the devices each window is split over (length a multiple of 2 x context).
    """
    if context > 1 and length % (2 * context):
        raise ConfigError(f"evaluation length {length} must be a multiple of 2 x mesh.context "
                          f"= {2 * context} to split it over {context} devices")
    x = np.asarray(tokens, np.int32)
    inputs, targets = x[:-1].reshape(-1, length), x[1:].reshape(-1, length)  # [W, length]
    rows = min(max(1, batch_tokens // length), len(inputs))
    eval_step, total, count = _evaluator(mcfg, context, objective), 0.0, 0.0
    for i in range(0, len(inputs), rows):
        inp, tgt = inputs[i:i + rows], targets[i:i + rows]
        mask = np.ones(inp.shape, np.float32)
        pad = ((0, rows - len(inp)), (0, 0))  # the last batch padded: one shape per length
        batch = {"inputs": np.pad(inp, pad), "targets": np.pad(tgt, pad),
                 "loss_mask": np.pad(mask, pad)}
        if objective is not None:  # MLM chooses no token of a padding row (segment 0)
            batch["segment_ids"] = np.pad(mask, pad).astype(np.int32)
        t, c, *_ = eval_step(params, batch)
        total, count = total + float(t), count + float(c)
    loss = total / count
    return math.exp(min(loss, 700.0)) if math.isfinite(loss) else None


def eval_config(mcfg: ModelConfig, scaling: str | None, multiple: int, train_len: int):
    """The trained model's config at multiple * L: with RoPE scaling of that factor, if any."""
    if scaling is None or multiple == 1:
        return mcfg
    return mcfg.replace(rope_scaling=RopeScaling(kind=scaling, factor=float(multiple),
                                                 original_max_seq_len=train_len))


def _print(*args):
    print(*args, flush=True)  # progress shows at once, also through a pipe or into a file


def run_study(cfg: StudyConfig, *, log=_print) -> dict:
    """Train every scheme for every seed, evaluate at every length; the results dict."""
    s, t = cfg.study, cfg.run.train
    log = log if s.progress else (lambda *a, **k: None)
    lengths, n_eval, started = cfg.eval_lengths, cfg.eval_tokens, time.perf_counter()
    ds = load_dataset(cfg.run.data, vocab_size=cfg.run.model.vocab_size, progress=s.progress,
                      log=log)
    if len(ds.val) < n_eval + 1:
        raise DataError(f"the validation split has {len(ds.val):,} tokens; study.eval_tokens "
                        f"needs {n_eval + 1:,}: lower it, or raise data.val_fraction")
    val = np.asarray(ds.val[:n_eval + 1])
    seeds = [t.seed + i for i in range(s.seeds)]
    objective = cfg.objective(ds.tokenizer)  # None: the LM loss
    log(f"data: {ds.source}; {len(s.schemes)} schemes x {len(seeds)} seed(s), each {t.steps} "
        f"steps of {t.batch_size} x {t.seq_len} tokens; evaluated on {n_eval:,} validation "
        f"tokens at lengths {', '.join(map(str, lengths))}")
    rows: dict[str, dict] = {}
    for i, scheme in enumerate(s.schemes):
        mcfg = cfg.model_config(scheme)
        scalings = [None] + (list(s.rope_scaling) if scheme in s.scaled_schemes else [])
        names = [scheme if k is None else f"{scheme}+{k}" for k in scalings]
        for name, scaling in zip(names, scalings):
            rows[name] = {"scheme": scheme, "scaling": scaling, "params": count_params(mcfg),
                          **column_fields(scheme, mcfg), "ppl": [],
                          **({"train_loss": [], "train_seconds": []} if scaling is None else {})}
        log(f"[{i + 1}/{len(s.schemes)}] {scheme}, seed(s) {', '.join(map(str, seeds))}: "
            f"{rows[scheme]['params']:,} params ({time.perf_counter() - started:.0f} s since "
            "the start)")
        t0 = time.perf_counter()
        stacked, losses = train_models(cfg, mcfg, ds.train, seeds, log, objective)
        seconds = round(time.perf_counter() - t0, 1)
        for k, (seed, loss) in enumerate(zip(seeds, losses)):
            rows[scheme]["train_loss"].append(loss if math.isfinite(loss) else None)
            rows[scheme]["train_seconds"].append(seconds)
            params = seed_slice(stacked, k)
            for name, scaling in zip(names, scalings):
                ppl = [perplexity(eval_config(mcfg, scaling, m, t.seq_len), params, val, n,
                                  s.eval_batch_tokens, cfg.run.mesh.context, objective)
                       if n <= mcfg.max_seq_len else None
                       for m, n in zip(s.eval_multiples, lengths)]
                rows[name]["ppl"].append(ppl)
                log(f"    {name}, seed {seed}, val ppl: " + "  ".join(
                    f"{n}: {'n/a' if p is None else f'{p:.3f}'}" for n, p in zip(lengths, ppl)))
    results = {"train_len": t.seq_len, "eval_multiples": list(s.eval_multiples),
               "eval_lengths": lengths, "eval_tokens": n_eval, "seeds": seeds,
               "data": ds.source, "config": cfg.to_dict(), "rows": rows,
               "seconds": round(time.perf_counter() - started, 1)}
    return summarize(results)


def main(argv=None) -> int:
    return study_main(argv, doc=__doc__, prog="python -m jaxformer.experiments.positions",
                      default_config=DEFAULT_CONFIG, small=SMALL, load=load_study_config,
                      run=run_study, write=write_outputs, errors=(ConfigError, DataError),
                      eval_lengths=("the evaluation lengths, as multiples of L = train.seq_len: "
                                    "e.g. L,2L,4L,8L,16L,32L (study.eval_multiples)",
                                    multiples_of_l))


if __name__ == "__main__":
    sys.exit(main())
