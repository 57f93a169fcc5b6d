"""Generate text from a training run:

    python -m jaxformer.generate --run runs/tiny --prompt "def " [--max-new-tokens 200
        --temperature 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --seed 0 --beam-width 4
        --best --weights int8 --draft prompt_lookup --draft-len 4]

Loads the run's config, tokenizer and latest checkpoint (or the best, with --best).
--weights int8 / bfloat16 reads the weights in that format (jaxformer.quantize); --draft
decodes speculatively (a proposer's name, such as prompt_lookup, or another run's
directory: a draft model with the same tokenizer) and prints the acceptance rate to stderr.
--min-new-tokens and --no-repeat-ngram-size constrain it (jaxformer.constraints).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import types

import jax
import numpy as np


def load_run_params(run_dir, *, step: int | None = None, best: bool = False):
    """(RunConfig, params) of a training run directory: the checkpoint at `step` (default
    the latest), or the best one; an adapter-sized one joined to its base (checked)."""
    from jaxformer.models import model_for
    from jaxformer.training.adapter_checkpoint import run_checkpointer
    from jaxformer.training.config import load_config
    from jaxformer.training.initial_weights import one_device_loader
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import abstract_state

    run = pathlib.Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} is not a training run (no config.yaml); pass the "
                                "train.run_dir of a run, e.g. runs/tiny")
    cfg = load_config(str(run / "config.yaml"))
    model = model_for(cfg.model)  # the Transformer, or an EncoderDecoder
    tx, _ = make_optimizer(cfg.optim, cfg.model, cfg.train.steps)
    abstract = abstract_state(model, tx)
    ckpt = run_checkpointer(cfg, run, load=one_device_loader(cfg), keep=cfg.checkpoint.keep,
                            async_save=False, read_only=True,
                            log=lambda message: print(message, file=sys.stderr))
    # on this process's first device, whatever mesh saved it (orbax would otherwise ask
    # for the saving run's devices: "Topology mismatch")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          abstract)
    try:
        state = ckpt.restore(target, cfg.model, step=step, best=best)
    except FileNotFoundError:
        raise FileNotFoundError(f"{run} has no {'best ' if best else ''}checkpoint yet; train "
                                f"it first (python train.py train.run_dir={run})") from None
    finally:
        ckpt.close()
    return cfg, state.params


def load_run(run_dir: str, *, best: bool = False, member: int | None = None):
    """(model, params, tokenizer) of a training run directory (a sweep's: adapter
    `member`'s)."""
    from jaxformer import lora
    from jaxformer.archs import ENCODER_DECODER
    from jaxformer.data import load_tokenizer
    from jaxformer.model import Transformer

    cfg, params = load_run_params(run_dir, best=best)
    if cfg.model.arch == ENCODER_DECODER:
        raise ValueError(f"{run_dir} is an encoder-decoder (model.arch={cfg.model.arch}), which "
                         "continues no prompt; decode its sources with python -m "
                         f"jaxformer.experiments.translate --run {run_dir}")
    m, params = lora.pick_member(cfg.model.lora, params, member)
    return Transformer(cfg.model.replace(lora=m)), params, load_tokenizer(run_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Generate text from a jaxformer training run.")
    p.add_argument("--run", required=True, help="a training run directory (train.run_dir)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beam-width", type=int, default=None, help="beam search instead of sampling")
    p.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
    p.add_argument("--member", type=int, default=None, help="a sweep run's adapter")
    p.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"))
    p.add_argument("--draft", default=None,
                   help="speculative decoding: prompt_lookup, or a draft run's directory")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--no-repeat-ngram-size", type=int, default=0,
                   help="n > 0: no n-gram twice in the prompt and its continuation")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="no end-of-text before this many new tokens")
    a = p.parse_args(argv)

    from jaxformer.constraints import Constraints
    from jaxformer.decoding import beam_search, generate
    from jaxformer.quantize import quantize
    from jaxformer.speculative import PROPOSERS
    from jaxformer.training.checkpoint import CheckpointError
    from jaxformer.training.loop import continuation_text
    try:
        model, params, tok = load_run(a.run, best=a.best, member=a.member)
        params = quantize(params, a.weights)
        draft = a.draft
        if draft is not None and draft not in PROPOSERS:  # a draft run's directory
            dmodel, dparams, _ = load_run(draft, best=a.best)
            draft = (dmodel, quantize(dparams, a.weights))
        prompt = np.asarray(tok.encode(a.prompt), np.int32)[None]
        if prompt.shape[1] == 0:
            raise ValueError("the prompt is empty; give at least one character")
        constraints = Constraints(a.min_new_tokens, a.no_repeat_ngram_size)
        if a.beam_width:
            out = beam_search(model, params, prompt, beam_width=a.beam_width,
                              max_new_tokens=a.max_new_tokens, eos_id=tok.eot_id,
                              constraints=constraints)
        else:
            out = generate(model, params, prompt, max_new_tokens=a.max_new_tokens,
                           rng=jax.random.key(a.seed), temperature=a.temperature,
                           top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, eos_id=tok.eot_id,
                           draft=draft, draft_len=a.draft_len, constraints=constraints)
            if draft is not None:
                print(f"draft acceptance rate: {out.acceptance_rate:.3f}", file=sys.stderr)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(continuation_text(tok, prompt[0], out.tokens[0], out.lengths[0]))
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module rebinds the package's `jaxformer.generate` (the function) to
    the module; calling it still generates, as jaxformer.decoding.generate."""

    def __call__(self, *args, **kwargs):
        from jaxformer.decoding import generate
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
