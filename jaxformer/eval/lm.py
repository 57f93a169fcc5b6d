"""jaxformer as an lm-evaluation-harness model: `JaxformerLM(path)`, registered with
lm-eval as "jaxformer" (`lm_eval --model jaxformer --model_args path=RUN` once this module
is imported). Requests are handled as lm-eval's `hf` model handles them: a continuation is
the tokens of context + continuation past the context's (encoded whole, then split), a
request longer than max_seq_len + 1 tokens loses its left end, an empty context is the
prefix token (the tokenizer's end-of-text). With `engine=true` generate_until runs through
the serving engine (jaxformer.serve: continuous batching, `batch_size` slots), so a short
continuation does not wait for the longest of its batch; the greedy tokens are the same.
`matmul_precision=P` scores and generates in another model.matmul_precision than the
model's (an fp8 run's per-tensor scales span the batch: its scores depend on the batch's
other requests; fp8_rowwise or default do not)."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxformer.core.sharding import sharding_context
from jaxformer.eval.loading import Loaded, load_model
from jaxformer.eval.scoring import Scorer, bucket
from jaxformer.model.build import with_precision

log = logging.getLogger(__name__)

BYTES_PREFIX = 10  # the byte tokenizer has no end-of-text: an empty context is "\n"


@register_model("jaxformer")
class JaxformerLM(TemplateLM):
    """loglikelihood, loglikelihood_rolling and generate_until (greedy, KV-cached:
    jaxformer.decode.loops.generate, or with engine=true jaxformer.serve's Engine) for a
    jaxformer run dir (RUN or RUN@STEP) or an HF folder, batched `batch_size` rows at a time
    into a few bucketed, jitted shapes."""

    def __init__(self, path: str | None = None, batch_size: int | str = 8,
                 max_gen_toks: int = 256, best: bool = False, loaded: Loaded | None = None,
                 engine: bool | str = False, matmul_precision: str | None = None, **_ignored):
        super().__init__()
        if loaded is None and path is None:
            raise ValueError("JaxformerLM needs path=RUN_DIR (or an HF folder)")
        loaded = loaded or load_model(path, best=bool(best))
        self.loaded = dataclasses.replace(loaded, model=with_precision(loaded.model,
                                                                       matmul_precision))
        self.tok = self.loaded.tokenizer
        self.scorer = Scorer(self.loaded, int(batch_size))
        self._max_gen_toks = int(max_gen_toks)
        self.engine = None  # built at the first generate_until when engine=true
        self.use_engine = str(engine).lower() in ("1", "true", "yes")

    # ---- what lm-eval asks of a model ------------------------------------------------

    @property
    def eot_token_id(self) -> int | None:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        return BYTES_PREFIX if self.tok.eot_id is None else self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self.loaded.model.cfg.max_seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tok.fingerprint

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The tokenizer's ids; jaxformer's tokenizers add no special tokens."""
        return self.tok.encode(string).tolist()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: (key, context ids, continuation ids) -> (log p(continuation | context),
        is_greedy); context + continuation left-truncated to max_seq_len + 1 tokens."""
        windows = []
        for _, ctx, cont in requests:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(f"a request needs a context and 1..{self.max_length} "
                                 f"continuation tokens, got {len(ctx)} and {len(cont)}")
            windows.append(((ctx + cont)[-(self.max_length + 1):], len(cont)))
        results = []
        step = self.scorer.rows * 16
        for start in tqdm(range(0, len(windows), step), disable=disable_tqdm,
                          desc="loglikelihood batches"):
            results += self.scorer.score(windows[start:start + step])
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, in disjoint windows of up to max_seq_len tokens that
        each see as much of the text before them as fits (lm-eval's rolling windows)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, pred))
                owner.append(i)
        totals = np.zeros(len(requests))
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of `until` (and end-of-text), at most
        max_gen_toks tokens; requests with the same generation settings decode together."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list = [None] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            if kwargs.get("do_sample"):
                log.warning("jaxformer.eval decodes greedily; do_sample=True is ignored")
            eos = None if self.tok.eot_id is None else self.tok.decode([self.tok.eot_id])
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            contexts = [requests[i].args[0] for i in members]
            texts = self._greedy(contexts, int(kwargs["max_gen_toks"]), disable_tqdm)
            for i, context, text in zip(members, contexts, texts):
                out[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    # ---- greedy decoding -------------------------------------------------------------

    def _greedy(self, contexts: list[str], max_new: int, disable_tqdm: bool) -> list[str]:
        """Each context's greedy continuation of max_new tokens (until end-of-text), as
        text; contexts left-truncated to max_seq_len - max_new tokens."""
        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in "
                             f"max_seq_len={self.max_length}; lower max_gen_toks")
        prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]
        if self.use_engine:
            return [self._text(ids) for ids in self._served(prompts, max_new)]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        rows, texts = self.scorer.rows, [None] * len(prompts)
        for start in tqdm(range(0, len(order), rows), disable=disable_tqdm,
                          desc="generate_until batches"):
            chunk = order[start:start + rows]
            tokens, lengths = self._decode([prompts[i] for i in chunk], room, max_new)
            for j, i in enumerate(chunk):
                texts[i] = self._text(tokens[j, :lengths[j]].tolist())
        return texts

    def _text(self, ids: list[int]) -> str:
        """A continuation's text, without its end-of-text."""
        if ids and ids[-1] == self.tok.eot_id:
            ids = ids[:-1]
        return self.tok.decode(ids)

    def _served(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Each prompt's greedy tokens (up to max_new, ending at end-of-text) through the
        serving engine: every prompt submitted at once, `batch_size` decoded together."""
        from jaxformer.serve.engine import Engine, RequestSettings

        if self.engine is None:
            mesh = self.loaded.mesh if self.loaded.mesh.size > 1 else None
            self.engine = Engine(self.loaded.model, self.loaded.params,
                                 slots=self.scorer.rows, mesh=mesh)
        ends = () if self.tok.eot_id is None else (self.tok.eot_id,)
        settings = RequestSettings(max_tokens=max_new, temperature=0.0, stop_token_ids=ends)
        ids = [self.engine.submit(p, settings) for p in prompts]
        made: dict[int, list[int]] = {i: [] for i in ids}
        while self.engine.has_work():
            for event in self.engine.step():
                made[event.request_id].append(event.token)
        return [made[i] for i in ids]

    def _decode(self, prompts: list[list[int]], room: int, max_new: int):
        """generate's greedy tokens [rows, max_new] and lengths [rows] for these prompts,
        right-padded to a bucketed width; rows past the prompts are one-token dummies."""
        from jaxformer.decode.loops import generate

        width = bucket(max(map(len, prompts)), room)
        rows = self.scorer.rows
        batch = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)
        for r, p in enumerate(prompts):
            batch[r, :len(p)], lengths[r] = p, len(p)
        with sharding_context(self.loaded.mesh, self.loaded.rules):
            out = generate(self.loaded.model, self.loaded.params, batch, prompt_lengths=lengths,
                           max_new_tokens=max_new, rng=jax.random.key(0), temperature=0.0,
                           eos_id=self.tok.eot_id)
        return np.asarray(out.tokens), np.asarray(out.lengths)
