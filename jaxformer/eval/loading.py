"""The model an evaluation scores: a jaxformer run dir (RUN or RUN@STEP, its config.yaml,
checkpoint and tokenizer, as `python -m jaxformer.generate --run` reads them) or a Hugging
Face folder (config.json + safetensors, read by jaxformer.hf.from_hf, and its
tokenizer.json), with its params placed on the run's mesh."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax

from jaxformer.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Loaded:
    model: Transformer
    params: Any             # placed by `shardings` on `mesh`
    tokenizer: Any          # jaxformer.data.Tokenizer
    mesh: jax.sharding.Mesh
    rules: tuple            # logical axis -> mesh axes (jaxformer.core.sharding.resolve_rules)


def _run(src, best: bool):
    """(ModelConfig, params, tokenizer, MeshConfig) of a run dir at src.step (or latest)."""
    from jaxformer.data import load_tokenizer
    from jaxformer.training.saved_run import load_run_params
    from jaxformer.model import lora

    cfg, params = load_run_params(src.path, step=src.step, best=best)
    m, params = lora.pick_member(cfg.model.lora, params, None)
    tok = load_tokenizer(src.path) if (src.path / "tokenizer.json").is_file() else None
    if tok is None:
        from jaxformer.data import ByteTokenizer
        tok = ByteTokenizer()  # a run saves tokenizer.json; an older one may lack it
    return cfg.model.replace(lora=m), params, tok, cfg.mesh


def _hf(src):
    """(ModelConfig, params, tokenizer, MeshConfig) of an HF folder."""
    from jaxformer.data import ByteTokenizer, load_tokenizer
    from jaxformer.hf import from_hf
    from jaxformer.training.config import MeshConfig

    cfg, params = from_hf(src.path)
    tok_file = src.path / "tokenizer.json"
    tok = load_tokenizer(tok_file) if tok_file.is_file() else ByteTokenizer()
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{src.path} has no tokenizer.json the model's vocab_size="
                         f"{cfg.vocab_size} fits; add the model's tokenizer.json")
    return cfg, params, tok, MeshConfig()


def read_model(spec: str | pathlib.Path, *, best: bool = False):
    """(ModelConfig, params, tokenizer, MeshConfig) of a run dir (RUN, RUN@STEP) or HF
    folder, the params on the host (python -m jaxformer.serve places them itself)."""
    from jaxformer.training.init_from import parse_source

    try:
        src = parse_source(str(spec))
    except FileNotFoundError:
        raise FileNotFoundError(f"{spec} is neither a jaxformer run dir (with config.yaml) nor "
                                "a Hugging Face model folder (with config.json)") from None
    return _run(src, best) if src.kind == "run" else _hf(src)


def load_model(spec: str | pathlib.Path, *, best: bool = False) -> Loaded:
    """The model, params, tokenizer and mesh of a run dir (RUN, RUN@STEP) or HF folder."""
    from jaxformer.core.sharding import make_mesh, param_shardings, resolve_rules

    cfg, params, tok, m = read_model(spec, best=best)
    model = Transformer(cfg)
    mesh = make_mesh(m.data, m.fsdp, m.tensor, context=m.context, expert=m.expert)
    rules = resolve_rules(m.rules)
    params = jax.device_put(params, param_shardings(model, mesh, rules))
    return Loaded(model, params, tok, mesh, rules)
