"""Convert between Hugging Face checkpoints and jaxformer training runs.

    python -m jaxformer.convert from-hf HF_DIR RUN_DIR [--scan-layers] [--dtype bfloat16]
        [--rope-layout interleaved] [section.key=value ...]
    python -m jaxformer.convert to-hf RUN_DIR|RUN_DIR/checkpoints/STEP|RUN_DIR/best/STEP HF_DIR
        [--best] [--dtype bfloat16] [--rope-layout interleaved] [--max-shard-mb N]
        [--into MULTIMODAL_DIR]

from-hf makes a run dir that train.py continues from: config.yaml (the inferred model plus
any overrides), the converted weights as the step-0 checkpoint (with a fresh optimizer
state), and the model's tokenizer.json when the HF folder has one. Fine-tune with
``python train.py RUN_DIR/config.yaml [train.steps=N optim.lr=...]``.
to-hf writes config.json and model.safetensors (plus tokenizer.json if the run has one);
with --into, a copy of that multimodal folder with the run's text model in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import sys

import yaml

def _run_config(cfg, run: pathlib.Path, has_tokenizer: bool, overrides):
    """The converted run's config: the model as converted, the overrides on top; an
    override that changes what the weights mean is refused."""
    from jaxformer.core.validation import merge
    from jaxformer.model.config import RUNTIME, ConfigError
    from jaxformer.model.mixers import changed_settings
    from jaxformer.training.config import RunConfig, parse_overrides

    data = {"tokenizer": str(run / "tokenizer.json")} if has_tokenizer else {}
    base = {"model": cfg.to_dict(), "data": data,
            "train": {"run_dir": str(run), "seq_len": min(256, cfg.max_seq_len)}}
    run_cfg = RunConfig.from_dict(merge(base, parse_overrides(list(overrides))))
    changed = [name for name, _, _ in changed_settings(run_cfg.model, cfg, RUNTIME)]
    if changed:  # model.config.RUNTIME: how the model runs, not what it computes
        raise ConfigError(f"model.{', model.'.join(changed)} would no longer match the "
                          "converted weights; from-hf overrides may set "
                          f"model.{', model.'.join(RUNTIME)}")
    return run_cfg


def _params_dtype(flag: str | None, override: str, overrides) -> str | None:
    """The converted params' dtype: --dtype, or a model.param_dtype override (the same
    setting); both, naming different dtypes, are refused."""
    from jaxformer.hf.folder import weights_dtype
    from jaxformer.model.config import ConfigError

    if not any(str(o).startswith("model.param_dtype=") for o in overrides):
        return flag
    if flag is not None and weights_dtype(flag) != override:
        raise ConfigError(f"--dtype {flag} and model.param_dtype={override} name the params' "
                          "dtype twice, differently; give one of them")
    return override


def from_hf_run(hf_dir: str, run_dir: str, overrides=(), *, dtype=None, scan_layers=False,
                rope_layout="half", log=print):
    """Convert HF_DIR into a training run dir whose step-0 checkpoint holds its weights."""
    import jax
    import jax.numpy as jnp

    from jaxformer.convert import from_hf, read_hf_config, read_hf_json
    from jaxformer.model.build import count_params
    from jaxformer.model.config import ConfigError
    from jaxformer.model.transformer import stack_layers, unstack_layers
    from jaxformer.training.checkpoint import Checkpointer
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import TrainState

    run = pathlib.Path(run_dir)
    if (run / "checkpoints").exists() or (run / "config.yaml").exists():
        raise ConfigError(f"{run} already holds a run (config.yaml or checkpoints/); convert "
                          "into a new run dir")
    hf = read_hf_json(hf_dir)
    tokenizer = pathlib.Path(hf_dir) / "tokenizer.json"
    asked = _run_config(read_hf_config(hf_dir), run, tokenizer.is_file(), overrides)  # before
    dtype = _params_dtype(dtype, asked.model.param_dtype, overrides)  # the weights are read
    cfg, params = from_hf(hf_dir, dtype=dtype, scan_layers=scan_layers, rope_layout=rope_layout)
    run_cfg = _run_config(cfg, run, tokenizer.is_file(), overrides)
    log(f"{hf_dir}: model_type {hf['model_type']} ({', '.join(hf.get('architectures') or [])}) "
        f"-> jaxformer model, {count_params(cfg):,} params:")
    log(yaml.safe_dump({"model": cfg.to_dict()}, sort_keys=False).rstrip())

    if run_cfg.model.scan_layers != cfg.scan_layers:
        params = stack_layers(params, cfg.n_layers) if run_cfg.model.scan_layers \
            else unstack_layers(params)
    fixed = run_cfg.data.tokenizer_entry.fixed  # the byte tokenizer: needs no file
    if not tokenizer.is_file() and fixed is not None and cfg.vocab_size < fixed.vocab_size:
        log(f"note: {hf_dir} has no tokenizer.json and {fixed!r} needs vocab_size >= "
            f"{fixed.vocab_size}; set data.tokenizer before training")

    tx, _ = make_optimizer(run_cfg.optim, run_cfg.model, run_cfg.train.steps)
    rng = jax.random.split(jax.random.PRNGKey(run_cfg.train.seed))[1]  # as init_state's
    state = TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params),
                       rng=rng)
    run.mkdir(parents=True, exist_ok=True)
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, run / "tokenizer.json")
    elif fixed is not None:  # as train.py would save it (generate reads it)
        fixed.save(run)
    ckpt = Checkpointer(run, keep=run_cfg.checkpoint.keep, async_save=False)
    try:
        ckpt.save(0, state, run_cfg.model)
        ckpt.wait()
    finally:
        ckpt.close()
    (run / "config.yaml").write_text(yaml.safe_dump(run_cfg.to_dict(), sort_keys=False))
    log(f"wrote {run}/config.yaml and {run}/checkpoints/0 (the converted weights, step 0)"
        f"{' and tokenizer.json' if tokenizer.is_file() else ''}; fine-tune with:\n"
        f"  python train.py {run}/config.yaml [section.key=value ...]\n"
        "(model.* and optim.clip_norm must stay as converted: the checkpoint holds them)")
    return run_cfg, state.params


def load_run_params(path: str, *, best: bool = False):
    """(RunConfig, params, run dir) of a run dir (latest or best checkpoint) or of one
    checkpoint step dir (RUN/checkpoints/STEP or RUN/best/STEP)."""
    from jaxformer.training.saved_run import load_run_params as restore

    src, step = pathlib.Path(path), None
    if not (src / "config.yaml").is_file() and src.name.isdigit() and \
            src.parent.name in ("checkpoints", "best"):
        src, step, best = src.parent.parent, int(src.name), src.parent.name == "best"
    if not (src / "config.yaml").is_file():
        raise FileNotFoundError(f"{path} is neither a training run dir (with config.yaml) nor a "
                                "checkpoint step dir (RUN_DIR/checkpoints/STEP)")
    cfg, params = restore(src, step=step, best=best)
    return cfg, params, src


def one_member(cfg, params, member: int | None):
    """A run's config and params as one adapter's (jaxformer.model.lora.pick_member)."""
    from jaxformer.model import lora

    m, params = lora.pick_member(cfg.model.lora, params, member)
    return dataclasses.replace(cfg, model=cfg.model.replace(lora=m)), params


def to_hf_run(path: str, hf_dir: str, *, best=False, dtype="float32", rope_layout="half",
              max_shard_bytes=None, member=None, into=None, model_type=None, log=print) -> dict:
    import json

    from jaxformer.convert import to_hf
    from jaxformer.data import HFTokenizer, load_tokenizer
    from jaxformer.hf.folder import weights_dtype

    weights_dtype(dtype)  # a bad one is refused before the run is read
    cfg, params, run = load_run_params(path, best=best)
    cfg, params = one_member(cfg, params, member)
    tok = load_tokenizer(run) if (run / "tokenizer.json").is_file() else None
    hf_tok = isinstance(tok, HFTokenizer)  # the byte tokenizer has no HF form
    extra = {"eos_token_id": tok.eot_id} if hf_tok and tok.eot_id is not None else {}
    hf = to_hf(cfg.model, params, hf_dir, dtype=dtype, rope_layout=rope_layout,
               max_shard_bytes=max_shard_bytes, config_overrides=extra, into=into,
               model_type=model_type)
    if hf_tok:
        shutil.copyfile(run / "tokenizer.json", pathlib.Path(hf_dir) / "tokenizer.json")
    log(f"{path} -> {hf_dir} ({hf['architectures'][0]}); config.json:")
    log(json.dumps(hf, indent=2, sort_keys=True))
    if tok is not None and not hf_tok:
        log(f"note: the run uses {tok!r} (token id = UTF-8 byte); no tokenizer.json written")
    auto = "AutoModelForCausalLM" if into is None else "AutoModelForImageTextToText"
    log(f"load it with transformers.{auto}.from_pretrained({str(hf_dir)!r})")
    return hf


def to_peft_run(path: str, peft_dir: str, *, best=False, base_model=None, rope_layout="half",
                member=None, model_type=None, log=print) -> dict:
    import json

    from jaxformer.convert.peft import to_peft

    cfg, params, run = load_run_params(path, best=best)
    cfg, params = one_member(cfg, params, member)
    base_model = base_model or cfg.train.init_from
    config = to_peft(cfg.model, params, peft_dir, base_model=base_model, rope_layout=rope_layout,
                     model_type=model_type)
    log(f"{path} -> {peft_dir}: adapter_config.json, adapter_model.safetensors")
    log(json.dumps({k: config[k] for k in ("r", "lora_alpha", "fan_in_fan_out",
                                           "base_model_name_or_path")}, sort_keys=True))
    log("load it with peft.PeftModel.from_pretrained(base, "
        f"{str(peft_dir)!r}), base: the HF model without the adapters")
    return config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxformer.convert",
                                description="Convert Hugging Face checkpoints to jaxformer runs "
                                "and back (every model type of jaxformer.hf.families; "
                                "safetensors only).")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="HF model folder -> jaxformer run dir")
    a.add_argument("hf_dir")
    a.add_argument("run_dir")
    a.add_argument("overrides", nargs="*", help="run config overrides, e.g. train.steps=100")
    a.add_argument("--scan-layers", action="store_true", help="stack the blocks (nn.scan)")
    b = sub.add_parser("to-hf", help="jaxformer run dir or checkpoint -> HF model folder")
    b.add_argument("run", help="RUN_DIR, RUN_DIR/checkpoints/STEP or RUN_DIR/best/STEP")
    b.add_argument("hf_dir")
    b.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
    b.add_argument("--max-shard-mb", type=float, default=None, help="split the weights")
    b.add_argument("--into", default=None, metavar="FOLDER", help="a multimodal HF folder "
                   "whose text model the run's is: write a copy of it with the run's weights")
    c = sub.add_parser("to-peft", help="a LoRA run's adapters -> a PEFT adapter folder")
    c.add_argument("run", help="RUN_DIR, RUN_DIR/checkpoints/STEP or RUN_DIR/best/STEP")
    c.add_argument("peft_dir")
    c.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
    c.add_argument("--base-model", default=None,
                   help="base_model_name_or_path to record (e.g. the HF folder it started from)")
    c.add_argument("--rope-layout", default="half", choices=("half", "interleaved"))
    for s in (b, c):
        s.add_argument("--member", type=int, default=None,
                       help="a sweep run's adapter (model.lora.sweep_rank / sweep_seeds)")
        s.add_argument("--model-type", default=None, help="write as this model type (e.g. "
                       "ernie4_5 for a model that is llama's computation too); default: the "
                       "first by export rank that reads back as the same model")
    for s in (a, b):
        s.add_argument("--dtype", default=None,
                       help="weights dtype: float32 (default), bfloat16 or float16")
        s.add_argument("--rope-layout", default="half", choices=("half", "interleaved"),
                       help="q/k layout of the HF checkpoint (interleaved: Meta's original)")
    args = p.parse_args(argv)

    from jaxformer.model.config import ConfigError
    from jaxformer.training.checkpoint import CheckpointError
    try:
        if args.command == "from-hf":
            from_hf_run(args.hf_dir, args.run_dir, args.overrides, dtype=args.dtype,
                        scan_layers=args.scan_layers, rope_layout=args.rope_layout)
        elif args.command == "to-peft":
            to_peft_run(args.run, args.peft_dir, best=args.best, base_model=args.base_model,
                        rope_layout=args.rope_layout, member=args.member,
                        model_type=args.model_type)
        else:
            if args.max_shard_mb is not None and not args.max_shard_mb > 0:
                raise ValueError(f"--max-shard-mb must be > 0, got {args.max_shard_mb:g}; "
                                 "leave it out for one model.safetensors")
            shard = None if args.max_shard_mb is None else max(1, int(args.max_shard_mb * 2**20))
            to_hf_run(args.run, args.hf_dir, best=args.best, dtype=args.dtype or "float32",
                      rope_layout=args.rope_layout, max_shard_bytes=shard, member=args.member,
                      into=args.into, model_type=args.model_type)
    except (ConfigError, FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
