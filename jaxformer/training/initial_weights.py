"""The weights a new run starts from (train.init_from, jaxformer.training.init_from): an HF
folder's, loaded one tensor at a time into the mesh's shardings, or a run's, restored
sharded by orbax; the new run's fresh LoRA adapters are kept beside them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.core.validation import ConfigError
from jaxformer.hf import from_hf
from jaxformer.model import lora
from jaxformer.model.build import model_for
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import stack_layers, unstack_layers
from jaxformer.training.adapter_checkpoint import run_checkpointer
from jaxformer.training.config import load_config
from jaxformer.training.init_from import Source, parse_source
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import abstract_state, state_shardings


def load_initial(spec: str, cfg: ModelConfig, params, param_shardings, mesh, rules, log=print):
    """params (a fresh init, for its LoRA adapters) with the base replaced by the source's
    weights, in `param_shardings`."""
    adapters, scales, _ = lora.partition(params, scales=True)
    try:
        src, base = load_base(spec, cfg, lora.partition(param_shardings, scales=True)[2], mesh,
                              rules)
    except FileNotFoundError as e:  # its message names the checkpoint and the saved steps
        raise ConfigError(f"train.init_from={spec}: {e}") from None
    log(f"init_from {spec}: {sum(x.size for x in jax.tree.leaves(base)):,} weights loaded "
        f"({src.kind}); {sum(x.size for x in jax.tree.leaves(adapters)):,} adapter params fresh")
    return lora.combine(adapters, scales, base)


def load_base(spec: str, cfg: ModelConfig, base_shardings, mesh, rules) -> tuple[Source, dict]:
    """(the parsed source, its weights as `cfg`'s params without adapters, placed in
    base_shardings)."""
    src = parse_source(spec)
    if src.kind == "hf":
        _, base = from_hf(src.path, dtype=cfg.param_dtype, shardings=base_shardings,
                          scan_layers=cfg.scan_layers)
    else:
        base = _run_weights(src, cfg, base_shardings, mesh, rules)
    return src, base


def base_loader(cfg: ModelConfig, param_shardings, mesh, rules):
    """spec -> the base weights of train.init_from=spec as load_base places them, for a
    model `cfg` whose params are placed in `param_shardings` (adapters or not)."""
    base_shardings = lora.partition(param_shardings, scales=True)[2]
    return lambda spec: load_base(spec, cfg, base_shardings, mesh, rules)[1]


def one_device_loader(cfg):
    """spec -> the base weights of train.init_from=spec on the first device, for a reader
    of a run (a RunConfig: generate, convert), which places them itself."""
    from jaxformer.core.sharding import make_mesh, param_shardings, resolve_rules

    def load(spec):
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        rules = resolve_rules(cfg.mesh.rules)
        base = model_for(cfg.model.replace(lora=lora.LoRAConfig()))
        return base_loader(cfg.model, param_shardings(base, mesh, rules), mesh, rules)(spec)
    return load


def _run_weights(src: Source, cfg: ModelConfig, base_shardings, mesh, rules):
    """A run's params at src.step (default latest), restored sharded, adapters merged,
    stacked or unstacked and cast as `cfg` wants, and placed in base_shardings."""
    run = load_config(str(src.path / "config.yaml"))
    model = model_for(run.model)  # the Transformer, or the EncoderDecoder
    tx, _ = make_optimizer(run.optim, run.model, run.train.steps)
    shardings = state_shardings(model, tx, mesh, rules)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            abstract_state(model, tx), shardings)
    loader = base_loader(run.model, shardings.params, mesh, rules)  # an adapter-only run's base
    ckpt = run_checkpointer(run, src.path, load=loader, keep=run.checkpoint.keep,
                            async_save=False, read_only=True)
    try:
        params = ckpt.restore(abstract, run.model, step=src.step).params
    finally:
        ckpt.close()
    if run.model.lora.rank:
        params = lora.merge(params, xp=jnp)
    if run.model.scan_layers != cfg.scan_layers:
        params = stack_layers(params, cfg.n_layers) if cfg.scan_layers else unstack_layers(params)
    return jax.tree.map(lambda x, sh: jax.device_put(x.astype(cfg.param_dtype), sh),
                        params, base_shardings)
