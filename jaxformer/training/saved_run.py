"""A training run directory read back: its config and parameters (load_run_params), or a
decoder ready to generate (load_run), whatever mesh saved it."""

from __future__ import annotations

import pathlib
import sys

import jax


def load_run_params(run_dir, *, step: int | None = None, best: bool = False):
    """(RunConfig, params) of a training run directory: the checkpoint at `step` (default
    the latest), or the best one; an adapter-sized one joined to its base (checked)."""
    from jaxformer.model.build import model_for
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
        saved = sorted((ckpt.best if best else ckpt.latest).all_steps())
        if step is not None and saved:
            raise FileNotFoundError(f"{run} has no {'best ' if best else ''}step {step}; saved "
                                    f"steps: {', '.join(map(str, saved))}") from None
        raise FileNotFoundError(f"{run} has no {'best ' if best else ''}checkpoint yet; train "
                                f"it first (python train.py train.run_dir={run})") from None
    finally:
        ckpt.close()
    return cfg, state.params


def load_run(run_dir: str, *, best: bool = False, member: int | None = None):
    """(model, params, tokenizer) of a training run directory (a sweep's: adapter
    `member`'s)."""
    from jaxformer.data import load_tokenizer
    from jaxformer.model import lora
    from jaxformer.model.archs import ARCHS
    from jaxformer.model.transformer import Transformer

    cfg, params = load_run_params(run_dir, best=best)
    if ARCHS[cfg.model.arch].encoder:  # it decodes sources, not prompts
        raise ValueError(f"{run_dir} is an encoder-decoder (model.arch={cfg.model.arch}), which "
                         "continues no prompt; decode its sources with python -m "
                         f"jaxformer.experiments.translate --run {run_dir}")
    m, params = lora.pick_member(cfg.model.lora, params, member)
    return Transformer(cfg.model.replace(lora=m)), params, load_tokenizer(run_dir)
