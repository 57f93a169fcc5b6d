"""What a run reports beside its losses: the validation loss (and perplexity) over the val
split or each source of a mixture, and the sample continued from train.sample_prompt."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.experimental.multihost_utils import process_allgather

from jaxformer.data import eval_batches
from jaxformer.decode.loops import generate
from jaxformer.training import objectives
from jaxformer.training.config import RunConfig


def evaluate(eval_step, params, tokens, docs, cfg: RunConfig, place=lambda b: b,
             rows=slice(None), data=None) -> dict:
    """Mean validation loss over cfg.train.eval_batches batches of the val tokens and
    docs, or of `data` (a loaded dataset) when given (this process reads its `rows` of
    each; `place` makes them global arrays). A mixture (data.mixture): each source's as
    val_loss/NAME, and val_loss their mean under the mixture's weights. An objective's
    metrics (training/objectives.py) as val_NAME; val_ppl where the loss has a perplexity."""
    extra = {}  # an objective's metrics' means

    def mean_loss(batches):
        sums = {}
        total = count = 0.0
        for batch in batches(batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                             max_batches=cfg.train.eval_batches, pack=cfg.data.pack, rows=rows):
            t, c, *more = eval_step(params, place(batch))
            total, count = total + np.asarray(t, np.float64), count + float(c)
            for k, v in (more[0] if more else {}).items():
                sums[f"val_{k}"] = sums.get(f"val_{k}", 0.0) + float(v)
        extra.update({k: v / max(count, 1.0) for k, v in sums.items()})
        return total / max(count, 1.0)  # [S] for a sweep of adapters: each one's

    parts = getattr(data, "parts", None)
    if parts:
        each = {f"val_loss/{p.name}": mean_loss(p.data.eval_batches) for p in parts}
        loss = sum(p.weight * each[f"val_loss/{p.name}"] for p in parts) / sum(
            p.weight for p in parts)
    else:
        each = {}
        loss = mean_loss(data.eval_batches if data is not None else
                         functools.partial(eval_batches, tokens, docs))
    out = {"val_loss": float(np.mean(loss))}
    if objectives.has_perplexity(cfg):  # not DPO's: a loss per pair of answers
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    out.update({k: float(np.mean(v)) for k, v in {**each, **extra}.items()})
    if np.ndim(loss):
        out["val_losses"] = [float(x) for x in loss]
    return out


def val_text(ev) -> str:
    """An evaluation's loss, and its perplexity where it has one, for the log."""
    ppl = f", val_ppl {ev['val_ppl']:.2f}" if "val_ppl" in ev else ""
    return f"val_loss {ev['val_loss']:.4f}{ppl}"


def sample_text(model, params, tokenizer, cfg: RunConfig) -> str | None:
    """The prompt and its continuation by the KV-cached decoder (None if it cannot fit)."""
    t = cfg.train
    prompt = np.asarray(tokenizer.encode(t.sample_prompt), np.int32)[None]
    new = min(t.sample_tokens, cfg.model.max_seq_len - prompt.shape[1])
    if prompt.shape[1] == 0 or new < 1:
        return None
    out = generate(model, params, prompt, max_new_tokens=new, rng=jax.random.key(t.seed),
                   temperature=t.sample_temperature, eos_id=tokenizer.eot_id)
    tokens, lengths = process_allgather((out.tokens, out.lengths), tiled=True)
    return continuation_text(tokenizer, prompt[0], tokens[0], lengths[0])


def continuation_text(tokenizer, prompt, tokens, length) -> str:
    """Decode a prompt and the first `length` generated tokens as one text."""
    return tokenizer.decode(np.concatenate([prompt, np.asarray(tokens[: int(length)])]))
