"""Generate text from a training run (the CLI; loading a run is jaxformer.training.saved_run):

    python -m jaxformer.generate --run runs/tiny --prompt "def " [--max-new-tokens 200
        --temperature 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --seed 0 --beam-width 4
        --best --weights int8 --draft prompt_lookup --draft-len 4 --cache-dtype int8
        --matmul-precision fp8_rowwise]

Loads the run's config, tokenizer and latest checkpoint (or the best, with --best).
--weights int8 / bfloat16 reads the weights in that format (jaxformer.model.quantize); --draft
decodes speculatively (a proposer's name, such as prompt_lookup, or mtp: the run's own
multi-token prediction modules, --draft-len defaulting to its model.mtp_depth; or another
run's directory: a draft model with the same tokenizer) and prints the acceptance rate to
stderr. --cache-dtype int8 keeps the KV cache in int8 with a scale per token and head
(jaxformer.attention.cache_formats: about half bf16's bytes), sampling or beam search.
--min-new-tokens and --no-repeat-ngram-size constrain it (jaxformer.decode.constraints).
--matmul-precision runs the weight matmuls in another model.matmul_precision than the run's
(e.g. an fp8 run, whose scales span the batch, in fp8_rowwise or default).
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from jaxformer.attention.cache_formats import CACHE_FORMATS
from jaxformer.core.low_precision import MATMUL_PRECISIONS
from jaxformer.core.moved import make_callable
from jaxformer.model.build import with_precision
from jaxformer.training.saved_run import load_run


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate text from a jaxformer training run.")
    p.add_argument("--run", required=True, help="a training run directory (train.run_dir)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=None, help="default 0.8; 0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beam-width", type=int, default=None,
                   help="beam search instead of sampling (1: greedy search)")
    p.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
    p.add_argument("--member", type=int, default=None, help="a sweep run's adapter")
    p.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"))
    p.add_argument("--cache-dtype", choices=tuple(CACHE_FORMATS), help="KV cache format")
    p.add_argument("--matmul-precision", choices=tuple(MATMUL_PRECISIONS),
                   help="the weight matmuls' precision (default: the run's "
                   "model.matmul_precision)")
    p.add_argument("--draft", default=None,
                   help="speculative decoding: prompt_lookup, mtp, or a draft run's directory")
    p.add_argument("--draft-len", type=int, default=None,
                   help="drafts per round (default 4; with --draft mtp, model.mtp_depth)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0,
                   help="n > 0: no n-gram twice in the prompt and its continuation")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="no end-of-text before this many new tokens")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = arguments(argv)
    from jaxformer.decode.constraints import Constraints
    from jaxformer.decode.loops import beam_search, generate
    from jaxformer.decode.speculative import PROPOSERS, default_draft_len
    from jaxformer.model.quantize import quantize
    from jaxformer.training.checkpoint import CheckpointError
    from jaxformer.training.evaluation import continuation_text
    try:
        checked_flags(a)
        model, params, tok = load_run(a.run, best=a.best, member=a.member)
        model = with_precision(model, a.matmul_precision)
        checked_for_run(a, tok)
        params = quantize(params, a.weights)
        draft = a.draft
        if draft is not None and draft not in PROPOSERS:  # a draft run's directory
            dmodel, dparams, _ = load_run(draft, best=a.best)
            draft = (with_precision(dmodel, a.matmul_precision), quantize(dparams, a.weights))
        prompt = np.asarray(tok.encode(a.prompt), np.int32)[None]
        if prompt.shape[1] == 0:
            raise ValueError("the prompt is empty; give at least one character")
        constraints = Constraints(a.min_new_tokens, a.no_repeat_ngram_size)
        draft_len = default_draft_len(model.cfg, draft) if a.draft_len is None else a.draft_len
        if a.beam_width is not None:
            out = beam_search(model, params, prompt, beam_width=a.beam_width,
                              max_new_tokens=a.max_new_tokens, eos_id=tok.eot_id,
                              constraints=constraints, cache_dtype=a.cache_dtype)
        else:
            out = generate(model, params, prompt, max_new_tokens=a.max_new_tokens,
                           rng=jax.random.key(a.seed),
                           temperature=0.8 if a.temperature is None else a.temperature,
                           top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, eos_id=tok.eot_id,
                           draft=draft, draft_len=draft_len, constraints=constraints,
                           cache_dtype=a.cache_dtype)
            if draft is not None:
                print(f"draft acceptance rate: {out.acceptance_rate:.3f}", file=sys.stderr)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(continuation_text(tok, prompt[0], out.tokens[0], out.lengths[0]))
    return 0


def checked_flags(a: argparse.Namespace):
    """Refuses flags that would be ignored (one ValueError line naming them)."""
    if a.beam_width is not None and a.beam_width < 1:
        raise ValueError(f"--beam-width must be >= 1 (1: greedy search), got {a.beam_width}; "
                         "leave it out to sample")
    sampling = {"--temperature": a.temperature, "--top-k": a.top_k, "--top-p": a.top_p,
                "--min-p": a.min_p, "--draft": a.draft, "--draft-len": a.draft_len}
    given = [flag for flag, value in sampling.items() if value is not None]
    if a.beam_width is not None and given:
        raise ValueError(f"--beam-width searches beams and does not sample: "
                         f"{', '.join(given)} would be ignored; drop them or --beam-width")
    if a.draft_len is not None and a.draft is None:
        raise ValueError("--draft-len sets the drafts of --draft, which is not given; pass "
                         "--draft (e.g. prompt_lookup) or leave --draft-len out")


def checked_for_run(a: argparse.Namespace, tok):
    """Refuses flags the loaded run cannot honour (one ValueError line)."""
    if a.min_new_tokens and tok.eot_id is None:
        raise ValueError(f"the run's tokenizer ({tok!r}) has no end-of-text token, so "
                         "--min-new-tokens has nothing to hold back; leave it out")


make_callable(__name__, "jaxformer.decode.loops:generate")

if __name__ == "__main__":
    sys.exit(main())
