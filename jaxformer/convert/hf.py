"""to_hf: (ModelConfig, params) -> a local Hugging Face model folder that transformers'
from_pretrained loads as the same model, written one tensor at a time; LoRA adapters are
merged into their weights on the way (and exported alone by jaxformer.convert.peft).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Callable

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (lets NumPy, hence safetensors, write bfloat16)
import numpy as np
from safetensors.numpy import save_file

from jaxformer.convert.hf_config import config_to_hf, differences
from jaxformer.hf.families import MODEL_TYPES
from jaxformer.hf.config_json import model_type_row
from jaxformer.hf.folder import (INDEX, WEIGHTS, Path, SafetensorsReader, by_path,
                                 model_folder, read_hf_json, weights_dtype)
from jaxformer.hf.multimodal import folder_row, text_config
from jaxformer.model import lora
from jaxformer.model.build import param_shapes
from jaxformer.model.config import ConfigError, ModelConfig
from jaxformer.model.encoder_decoder import layer_stacks
from jaxformer.model.layer_runs import is_stacked, locate
from jaxformer.model.lora import LoRAConfig


def to_hf(cfg: ModelConfig, params, path, *, dtype="float32", rope_layout: str = "half",
          max_shard_bytes: int | None = None, config_overrides: dict | None = None,
          model_type: str | None = None, into=None) -> dict:
    """Write config.json and safetensors weights that transformers' from_pretrained loads as
    the same model; returns the config.json written. params: per-layer or stacked
    ("blocks"); LoRA adapters (cfg.lora) are merged into their weights, in float64, one
    tensor at a time. A model HF cannot express is a ConfigError naming the field.

    dtype: the weights' dtype on disk. max_shard_bytes: split the weights into shards of
    about that size with an index (default: one model.safetensors). config_overrides: extra
    config.json keys (e.g. bos_token_id / eos_token_id for a tokenizer). Weight files of
    an earlier export in `path` (model*.safetensors, the index) are replaced. model_type:
    as that type (config_to_hf). into: a multimodal folder (the model's text model read
    from it): `path` becomes a copy of it, its language model's tensors ours (write_into).
    """
    dtype = jnp.dtype(weights_dtype(dtype))
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}; pass None for "
                         "one model.safetensors")
    if into is not None:
        return write_into(cfg, params, path, into, rope_layout)
    plain = cfg.replace(lora=LoRAConfig())  # LoRA adapters are merged into their weights
    hf = config_to_hf(plain, dtype.name, model_type)
    hf.update(config_overrides or {})
    row = MODEL_TYPES[hf["model_type"]]
    rules = row.tensor_rules(plain.replace(scan_layers=False), row, rope_layout)
    get = merged_getter(cfg, params)
    out = pathlib.Path(path)
    write_weights(out, ((name, arr) for rule in rules
                        for name, arr in zip(rule.hf, rule.to_hf(*[get(p) for p in rule.ours]))),
                  dtype, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return hf


def write_weights(out: pathlib.Path, tensors, dtype, max_shard_bytes: int | None) -> None:
    """The (HF name, array) pairs as `dtype` into out/model.safetensors, or into shards of
    about max_shard_bytes with an index; an earlier export's weight files are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / WEIGHTS, out / INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    written: list[tuple[str, list[str]]] = []
    size = total = 0

    def flush():
        if shards[-1]:
            tmp = out / f"model-{len(written) + 1:05d}.tmp.safetensors"
            save_file(shards[-1], str(tmp), metadata={"format": "pt"})
            written.append((tmp.name, list(shards[-1])))
            shards[-1] = {}

    for name, arr in tensors:
        arr = np.ascontiguousarray(arr.astype(dtype)).reshape(arr.shape)  # 0-d stays
        if max_shard_bytes and shards[-1] and size + arr.nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = arr
        size, total = size + arr.nbytes, total + arr.nbytes
    flush()
    if len(written) == 1:
        os.replace(out / written[0][0], out / WEIGHTS)
        return
    weight_map = {}
    for i, (tmp, names) in enumerate(written, 1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(out / tmp, out / final)
        weight_map.update({n: final for n in names})
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2))


def write_into(cfg: ModelConfig, params, path, into, rope_layout: str = "half") -> dict:
    """to_hf(into=FOLDER): a copy of multimodal folder FOLDER at `path` (every file, every
    tensor of the vision tower and the projector as they are), its language model's
    tensors replaced by the model's, each in its dtype there; returns its config.json. A
    folder that is not multimodal, or whose text model differs from cfg's (a checkpoint of
    another config), is a ConfigError line."""
    src, out = model_folder(into), pathlib.Path(path)
    hf, plain = read_hf_json(src), cfg.replace(lora=LoRAConfig(), scan_layers=False)
    row = model_type_row(hf)
    text = folder_row(hf, row)
    if text is row:
        raise ConfigError(f"to_hf: into={src} is a {row.name} folder, not a multimodal one; "
                          "without `into`, to_hf writes the text model's own folder")
    if out.resolve() == src.resolve():
        raise ConfigError(f"to_hf: into={src} is the output folder; write the copy elsewhere")
    diffs = differences(plain, text_config(hf, row))
    if diffs:
        raise ConfigError(f"to_hf: {src}'s text model differs from this model in "
                          f"model.{', model.'.join(diffs)}: a checkpoint of another config")
    rules = text.tensor_rules(plain, text, rope_layout)
    where = {name: (i, j) for i, r in enumerate(rules) for j, name in enumerate(r.hf)}
    reader, get = SafetensorsReader(src), merged_getter(cfg, params)
    try:
        if plain.tie_embeddings and text.head_tensor in reader.files:  # saved beside: equal
            where[text.head_tensor] = where[rules[0].hf[0]]
        missing = sorted(set(where) - set(reader.files))
        if missing:
            raise ConfigError(f"to_hf: {src} lacks {len(missing)} of the text model's "
                              f"tensors ({', '.join(missing[:4])})")
        out.mkdir(parents=True, exist_ok=True)
        for stale in [out / WEIGHTS, out / INDEX, *out.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
        shutil.copytree(src, out, dirs_exist_ok=True, ignore=lambda d, names: [
            n for n in names if n.endswith(".safetensors") or n == INDEX])
        for file in sorted(set(reader.files.values())):
            tensors = {}
            for name in (n for n, f in reader.files.items() if f == file):
                old = reader.read(name)
                tensors[name] = old if name not in where else _hf_tensor(
                    rules, where[name], get, old, src / file.name)
            save_file(tensors, str(out / file.name), metadata={"format": "pt"})
        if (src / INDEX).is_file():
            shutil.copyfile(src / INDEX, out / INDEX)
    finally:
        reader.close()
    return hf


def _hf_tensor(rules, at: tuple[int, int], get, old: np.ndarray, file) -> np.ndarray:
    """The HF tensor `at` (rule i's j-th) of the model's params, in `old`'s dtype; `old`:
    the tensor it replaces in `file`, whose shape it must have."""
    rule = rules[at[0]]
    new = rule.to_hf(*[get(p) for p in rule.ours])[at[1]]
    if new.shape != old.shape:
        raise ConfigError(f"to_hf: tensor {rule.hf[at[1]]} in {file} has shape "
                          f"{list(old.shape)}, this model's {list(new.shape)}")
    return np.ascontiguousarray(new.astype(old.dtype)).reshape(old.shape)


def merged_getter(cfg: ModelConfig, params) -> Callable[[Path], np.ndarray]:
    """param_getter's arrays, each kernel with its LoRA adapter (if any) folded in:
    W + (alpha / r) A B, computed in float64 (jaxformer.model.lora.delta)."""
    get, targets = param_getter(cfg, params), cfg.lora.projections()

    def merged(path: Path) -> np.ndarray:
        w = get(path)
        if path[-1] != "kernel" or path[-2] not in targets:
            return w
        return (w.astype(np.float64) + adapter_update(get, path)).astype(w.dtype)

    return merged


def adapter_update(get, kernel_path: Path) -> np.ndarray:
    """A kernel's LoRA update lora_scale A B in float64, shaped like the kernel; `get`: a
    param_getter."""
    a, b, scale = (get(lora.adapter_path(kernel_path, leaf)) for leaf in
                   ("lora_a", "lora_b", lora.SCALE))
    return lora.delta(np.float64(a), np.float64(b), get(kernel_path).ndim, float(scale), np)


def param_getter(cfg: ModelConfig, params) -> Callable[[Path], np.ndarray]:
    """path (per-layer form) -> the param as a NumPy array, after checking the tree against
    the config; a stacked param is sliced on its device, one layer at a time."""
    flat = by_path(params)
    stacks = layer_stacks(cfg)  # (path prefix, its config): encoder/ and decoder/ or the top
    stacked = any(is_stacked(p[len(prefix)]) for p in flat for prefix, _ in stacks
                  if p[:len(prefix)] == prefix)
    expected = by_path(param_shapes(cfg.replace(scan_layers=stacked)))
    show = lambda ps: ", ".join("/".join(p) for p in ps[:6])  # noqa: E731
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {show(missing) or 'none'}; "
                         f"unexpected {show(extra) or 'none'}")
    for p, leaf in flat.items():
        if tuple(leaf.shape) != tuple(expected[p].shape):
            raise ValueError(f"param {'/'.join(p)} has shape {list(leaf.shape)}, but the config "
                             f"implies {list(expected[p].shape)}")

    def get(path: Path) -> np.ndarray:
        for prefix, stack in stacks if stacked else ():
            n = len(prefix)
            if path[:n] == prefix and path[n].startswith("block_"):
                name, j = locate(stack.layer_runs, int(path[n][6:]))
                return np.asarray(flat[prefix + (name,) + path[n + 1:]][j])
        return np.asarray(flat[path])

    return get
