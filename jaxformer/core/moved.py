"""Where the modules of jaxformer's flat layout went when the package moved into wings
(core, positions, attention, moe, model, decode, ...): importing an old path fails in one
line naming the new one, rather than a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types

MOVED = {
    "jaxformer.archs": "jaxformer.model.archs",
    "jaxformer.backend_rules": "jaxformer.attention.rules",
    "jaxformer.backends": "jaxformer.attention.backends",
    "jaxformer.blockwise": "jaxformer.attention.blockwise",
    "jaxformer.cached_forward": "jaxformer.decode.cached_forward",
    "jaxformer.chunked": "jaxformer.attention.chunked",
    "jaxformer.config": "jaxformer.model.config",
    "jaxformer.constraints": "jaxformer.decode.constraints",
    "jaxformer.cope": "jaxformer.positions.cope",
    "jaxformer.cross_attention": "jaxformer.model.cross_attention",
    "jaxformer.decoding": "jaxformer.decode.loops",
    "jaxformer.expert_parallel": "jaxformer.moe.expert_parallel",
    "jaxformer.grouped_matmul": "jaxformer.moe.grouped_matmul",
    "jaxformer.grouped_vmap": "jaxformer.moe.grouped_vmap",
    "jaxformer.hooks": "jaxformer.core.hooks",
    "jaxformer.host_memory": "jaxformer.core.host_memory",
    "jaxformer.inspect": "jaxformer.model.inspect",
    "jaxformer.kinds": "jaxformer.model.kinds",
    "jaxformer.kv_cache": "jaxformer.attention.kv_cache",
    "jaxformer.layer_kinds": "jaxformer.model.layer_pattern",
    "jaxformer.layer_runs": "jaxformer.model.layer_runs",
    "jaxformer.layers": "jaxformer.model.blocks",
    "jaxformer.logprobs": "jaxformer.core.logprobs",
    "jaxformer.lora": "jaxformer.model.lora",
    "jaxformer.masks": "jaxformer.attention.masks",
    "jaxformer.matmul": "jaxformer.core.matmul",
    "jaxformer.mla": "jaxformer.attention.mla",
    "jaxformer.mla_attention": "jaxformer.model.latent_attention",
    "jaxformer.models": "jaxformer.model.build",
    "jaxformer.norms": "jaxformer.model.norms",
    "jaxformer.presets": "jaxformer.model.presets",
    "jaxformer.quantize": "jaxformer.model.quantize",
    "jaxformer.reference": "jaxformer.core.reference",
    "jaxformer.ring": "jaxformer.attention.ring",
    "jaxformer.rope_scaling": "jaxformer.positions.rope_scaling",
    "jaxformer.sampling": "jaxformer.decode.sampling",
    "jaxformer.schemes": "jaxformer.positions.schemes",
    "jaxformer.seq2seq_decoding": "jaxformer.decode.seq2seq",
    "jaxformer.seq2seq_model": "jaxformer.model.encoder_decoder",
    "jaxformer.sharding": "jaxformer.core.sharding",
    "jaxformer.speculative": "jaxformer.decode.speculative",
    "jaxformer.splash": "jaxformer.attention.splash",
    "jaxformer.training.balancing": "jaxformer.moe.balancing",
    "jaxformer.validation": "jaxformer.core.validation",
}


class MovedModules(importlib.abc.MetaPathFinder):
    """A finder that answers an old module path with the error naming its new home."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(f"{fullname} is now {MOVED[fullname]} (jaxformer's modules "
                                      "live in wings: see docs/layout.md)", name=fullname)
        return None


def install() -> None:
    """Put the finder on sys.meta_path once."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())


def make_callable(module_name: str, function: str) -> None:
    """Let a module that shares its name with a function of its package be called as the
    function (`module:name`, imported at the call). Importing `jaxformer.generate` or
    `jaxformer.data.prepare` binds the package's attribute to the module, in place of the
    function a user imported the package for; calling the module still runs it."""
    home, name = function.split(":")

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(importlib.import_module(home), name)(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
