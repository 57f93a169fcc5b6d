"""Serve a model over OpenAI's HTTP API (jaxformer.serve.server):

    python -m jaxformer.serve RUN|HF_FOLDER [--port 8000 --host 127.0.0.1 --slots 32
        --page-size 16 --pages N --prefill-chunk 128 --max-queue 256 --model-name NAME
        --tensor 2 --best --weights int8 --cache-dtype int8 --matmul-precision P
        --compile all]

RUN is a training run directory (its config.yaml, latest checkpoint, or the best with --best,
and tokenizer.json); HF_FOLDER a Hugging Face model folder (config.json, safetensors,
tokenizer.json). The folder's chat template (tokenizer_config.json or chat_template.jinja)
serves /v1/chat/completions. The engine compiles every program a step may run before the
server listens (--compile first: those of two short requests), so /health answers once it is
ready and no request waits for a compile. --cache-dtype int8 keeps the KV cache's pages in
int8 with a float32 scale per token and head (as generate --cache-dtype int8): 0.27x the
bytes of float32 at head_dim 64, so the same memory holds 3.8x the pages (--pages).
--matmul-precision runs the weight matmuls in another entry of model.matmul_precision's table
than the model's; one whose scales span the batch (fp8: one per tensor) makes a request's
tokens depend on the requests batched with it, which the server warns of at start
(fp8_rowwise scales each token apart).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxformer.attention.cache_formats import CACHE_FORMATS
from jaxformer.core.low_precision import MATMUL_PRECISIONS


def port(text: str) -> int:
    """--port's value: a TCP port, 0 (any free one) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; pass 0 to 65535")
    return int(text)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxformer.serve",
                                description="An OpenAI-compatible server for a model.")
    p.add_argument("model", help="a training run directory or a Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--slots", type=int, default=32, help="sequences decoded together")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    p.add_argument("--pages", type=int, default=None, help="KV-cache pages (default: enough "
                   "for every slot at the model's context)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per step")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; one more is answered 429")
    p.add_argument("--model-name", default=None, help="the name clients ask for (default: "
                   "the folder's name)")
    p.add_argument("--tensor", type=int, default=1, help="devices the weights are split "
                   "over (tensor parallel; the first N devices)")
    p.add_argument("--best", action="store_true", help="a run's best checkpoint")
    p.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"))
    p.add_argument("--cache-dtype", default=None, choices=tuple(CACHE_FORMATS),
                   help="the KV cache pages' format (default: the model's dtype)")
    p.add_argument("--matmul-precision", default=None, choices=tuple(MATMUL_PRECISIONS),
                   help="the weight matmuls' precision (default: the model's "
                   "model.matmul_precision)")
    p.add_argument("--compile", default="all", choices=("all", "first"),
                   help="all: every program a step may run before listening (no request "
                   "waits for a compile); first: the programs of two short requests")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def load(path: str, best: bool, precision: str | None = None):
    """(model, params, tokenizer) of a run directory or a Hugging Face
    folder, read as python -m jaxformer.eval reads them; precision: its
    model.matmul_precision for serving (None: its own)."""
    from jaxformer.eval.loading import read_model
    from jaxformer.model.archs import ARCHS
    from jaxformer.model.build import with_precision
    from jaxformer.model.transformer import Transformer

    cfg, params, tok, _ = read_model(path, best=best)
    if ARCHS[cfg.arch].encoder:
        raise ValueError(f"{path} is an encoder-decoder (model.arch={cfg.arch}), which "
                         "continues no prompt; serve a decoder")
    model = with_precision(Transformer(cfg), precision)
    if not MATMUL_PRECISIONS[model.cfg.matmul_precision].batch_invariant:
        print(f"warning: model.matmul_precision={model.cfg.matmul_precision} scales each "
              "matmul over the whole batch, so a request's tokens depend on the requests "
              "decoded beside it; --matmul-precision fp8_rowwise (or default) scales each "
              "token apart", file=sys.stderr)
    return model, params, tok


def warm_up(engine, end_ids, every: bool) -> None:
    """Compile the engine's step: every program it may run (Engine.warm), then by
    serving two short requests (greedy and sampled), which alone `every` false runs."""
    from jaxformer.serve.engine import RequestSettings
    if every:
        engine.warm()
    engine.submit([0], RequestSettings(max_tokens=2, temperature=0.0, stop_token_ids=end_ids))
    engine.submit([0, 0], RequestSettings(max_tokens=2, seed=0, logprobs=1))
    while engine.has_work():
        engine.step()


def served_of(a: argparse.Namespace):
    """The Served model of the command line: loaded, its engine built and compiled."""
    from jaxformer.model.quantize import quantize
    from jaxformer.serve.async_engine import AsyncEngine
    from jaxformer.serve.engine import Engine
    from jaxformer.serve.prompts import ChatTemplate, end_ids, special_token_encoder
    from jaxformer.serve.server import Served

    model, params, tok = load(a.model, a.best, a.matmul_precision)
    mesh = None
    if a.tensor > 1:
        import jax
        from jaxformer.core.sharding import make_mesh
        mesh = make_mesh(1, 1, a.tensor, devices=jax.devices()[:a.tensor])
    engine = Engine(model, quantize(params, a.weights), slots=a.slots, page_size=a.page_size,
                    pages=a.pages, prefill_chunk=a.prefill_chunk, mesh=mesh,
                    cache_dtype=a.cache_dtype)
    folder = pathlib.Path(a.model)
    ends = end_ids(folder, tok)
    warm_up(engine, ends, a.compile == "all")
    name = a.model_name or folder.resolve().name
    return Served(AsyncEngine(engine, max_queue=a.max_queue, slots=a.slots), tok, name,
                  engine.max_seq_len, ends, ChatTemplate.of_folder(folder),
                  special_token_encoder(tok), special_token_encoder(tok, True),
                  no_chat=f"{name} has no chat template (no chat_template in {folder}/"
                          "tokenizer_config.json nor a chat_template.jinja); use "
                          "/v1/completions, or add a template to the folder")


def main(argv=None) -> int:
    a = parse(argv)
    from jaxformer.training.checkpoint import CheckpointError
    try:
        served = served_of(a)
    except (FileNotFoundError, ValueError, CheckpointError) as e:  # a DataError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn
    from jaxformer.serve.server import make_app
    print(f"serving {served.model_name} at http://{a.host}:{a.port}/v1", file=sys.stderr,
          flush=True)
    uvicorn.run(make_app(served), host=a.host, port=a.port, log_level=a.log_level,
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
