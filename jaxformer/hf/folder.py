"""from_hf: a local Hugging Face model folder -> (ModelConfig, params).

Weights are read with safetensors only (never pickle), one tensor at a time, and each param
is placed as soon as it is built: with ``shardings`` every device receives only its own
slice (``jax.make_array_from_callback``), so no device ever holds a full copy. Writing a
folder (to_hf) is jaxformer.convert's.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (lets NumPy, hence safetensors, read bfloat16)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxformer.hf.config_json import config_from_hf, model_type_row
from jaxformer.hf.mla_layout import mtp_held
from jaxformer.hf.multimodal import folder_row
from jaxformer.model.build import param_shapes
from jaxformer.model.config import DTYPES, ConfigError, ModelConfig
from jaxformer.model.encoder_decoder import layer_stacks

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
Path = tuple[str, ...]
WEIGHT_DTYPES = DTYPES  # what weights are read and written in


def weights_dtype(dtype) -> str:
    """The name of `dtype` when weights may be held in it (WEIGHT_DTYPES); else one
    ValueError line (int8 would truncate every weight, float8 is no NumPy dtype)."""
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in WEIGHT_DTYPES:
        raise ConfigError(f"dtype {dtype} is not a weights dtype; pass one of "
                         f"{', '.join(WEIGHT_DTYPES)}")
    return name


# ---- reading ----------------------------------------------------------------------


def model_folder(path) -> pathlib.Path:
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; expected a local Hugging Face model "
                                f"folder with config.json and {WEIGHTS} (or {INDEX} and its "
                                "shards)")
    return folder


def read_hf_json(path) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model folder."""
    file = model_folder(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; a Hugging Face model folder holds "
                                "config.json beside its weights")
    return json_object(file)


def json_object(file: pathlib.Path) -> dict[str, Any]:
    """The JSON object a folder's file holds (one ValueError line naming it otherwise)."""
    try:
        hf = json.loads(file.read_text(), object_hook=_special_float)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return hf


def _special_float(obj: dict):
    """transformers' JSON spelling of inf and nan ({"__float__": "Infinity"}) as a float."""
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def read_hf_config(path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model folder, without reading any weights (e.g. to
    build shardings for from_hf); MTP modules only where its tensor names hold them."""
    hf = read_hf_json(path)
    cfg = config_from_hf(hf)
    if not cfg.mtp_depth:
        return cfg
    try:
        reader = SafetensorsReader(model_folder(path))
    except FileNotFoundError:  # a config alone
        return cfg
    try:
        return mtp_held(cfg, reader.files, folder_row(hf, model_type_row(hf)).tensor_prefix)
    finally:
        reader.close()


class SafetensorsReader:
    """The tensors of a model folder (model.safetensors, or an index and its shards), read
    lazily one at a time."""

    def __init__(self, folder: pathlib.Path):
        index, single = folder / INDEX, folder / WEIGHTS
        self._stack = contextlib.ExitStack()
        self._handles: dict[pathlib.Path, Any] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index} has no weight_map object")
            self.files = {name: folder / file for name, file in weight_map.items()}
            missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists shard(s) that do not exist: "
                                        f"{', '.join(missing)}")
        elif single.is_file():
            self.files = {name: single for name in self._open(single).keys()}
        else:
            found = sorted(p.name for p in folder.iterdir() if p.suffix in
                           (".bin", ".pt", ".pth", ".ckpt", ".safetensors", ".h5", ".msgpack"))
            hint = (f" (found {', '.join(found)}; only safetensors are read, never pickle: "
                    "re-save with save_pretrained(..., safe_serialization=True))" if found else "")
            raise FileNotFoundError(f"no {WEIGHTS} or {INDEX} in {folder}{hint}")

    def _open(self, file: pathlib.Path):
        if file not in self._handles:
            try:
                handle = safe_open(str(file), "numpy")
            except SafetensorError as e:  # (a ConfigError: train.init_from=FOLDER says it)
                raise ConfigError(f"{file} is incomplete or corrupt ({e}); download or save "
                                  "it again") from None
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self._open(self.files[name]).get_tensor(name)

    def close(self):
        self._stack.close()


def _resolve(reader: SafetensorsReader, rules, row, folder) -> dict[str, str]:
    """Our table's HF names -> names in the files (with or without the model prefix), after
    checking that every tensor is there with the shape the config implies, and no other."""
    prefix, present = row.tensor_prefix, set(reader.files)
    names, missing = {}, []
    for rule in rules:
        for name, shape in zip(rule.hf, rule.hf_shapes):
            bare = name[len(prefix):] if name.startswith(prefix) else None
            actual = name if name in present else bare if bare in present else None
            if actual is None:
                missing.append(name)
                continue
            got = reader.shape(actual)
            if got != shape:
                raise ConfigError(f"tensor {actual} in {folder} has shape {list(got)}, but "
                                 f"config.json implies {list(shape)}")
            names[name] = actual
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ConfigError(f"{len(missing)} tensor(s) that config.json implies are missing from "
                         f"{folder}: {', '.join(missing[:8])}{more}")
    extra = sorted(n for n in present - set(names.values())
                   if not any(re.fullmatch(p, n) for p in row.ignored_tensors))
    tied_head = row.head_tensor
    if tied_head in extra and "lm_head" not in {p[0] for r in rules for p in r.ours}:
        embed = names[rules[0].hf[0]]  # a tied head must equal the embedding
        if not np.array_equal(reader.read(tied_head), reader.read(embed)):
            raise ConfigError(f"config.json ties the embeddings (tie_word_embeddings), but "
                             f"{tied_head} in {folder} differs from {embed}")
        extra.remove(tied_head)
    if row.extra_layers and extra:
        extra = _skip_extra_layers(extra, names.values(), row)
    if extra:
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise ConfigError(f"unexpected tensor(s) in {folder} that config.json does not account "
                         f"for: {', '.join(extra[:8])}{more}")
    return names


def _skip_extra_layers(extra: list[str], used, row) -> list[str]:
    """The unexpected tensors less those of layers past the model's last, which are skipped
    with one line (row.extra_layers says what they are: DeepSeek-V3's multi-token
    prediction)."""
    layer = re.compile(r"(?:model\.)?layers\.(\d+)\.")
    n = 1 + max((int(m.group(1)) for u in used if (m := layer.match(u))), default=-1)
    past = [e for e in extra if (m := layer.match(e)) and int(m.group(1)) >= n]
    if past:
        layers = sorted({int(layer.match(e).group(1)) for e in past})
        print(f"from_hf: skipping layer(s) {', '.join(map(str, layers))} ({len(past)} tensors): "
              f"{row.extra_layers}", file=sys.stderr, flush=True)
    return [e for e in extra if e not in past]


def by_path(tree) -> dict[Path, Any]:
    """The leaves of a pytree (or of a tree of Shardings) by their key paths."""
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {tuple(getattr(k, "key", k) for k in path): leaf for path, leaf in leaves}


def _unflatten(flat: dict[Path, Any]) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def _shardings_for(shardings, expected: dict[Path, Any]) -> dict[Path, Any]:
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return {path: shardings for path in expected}
    flat = by_path(shardings)
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or extra:
        show = lambda ps: ", ".join("/".join(p) for p in ps[:6]) or "none"  # noqa: E731
        raise ValueError(f"shardings must match the param tree: missing {show(missing)}; "
                         f"unexpected {show(extra)}")
    return flat


def from_hf(path, *, dtype=None, shardings=None, scan_layers: bool = False,
            rope_layout: str = "half") -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a local Hugging Face model folder of any model type in
    jaxformer.hf.families.

    dtype: the params' dtype (and the config's param_dtype); default float32.
    shardings: None (the default device), one jax.sharding.Sharding for every param, a
      pytree of Shardings matching the params, or a function of the ModelConfig returning
      one of those. Each param is built on the host and sent to each device as its slice.
    scan_layers: return the blocks stacked under "blocks" (each run of cfg.layer_runs) and
      scan_layers=True.
    rope_layout: "interleaved" if the checkpoint's q/k weights rotate interleaved pairs
      (Meta's original format); they are permuted to the half-rotation layout.
    """
    folder = model_folder(path)
    hf = read_hf_json(folder)
    cfg = config_from_hf(hf).replace(param_dtype=weights_dtype(dtype or "float32"),
                                     scan_layers=scan_layers)
    row = folder_row(hf, model_type_row(hf))  # a multimodal folder: its text model's
    reader = SafetensorsReader(folder)
    try:
        cfg = mtp_held(cfg, reader.files, row.tensor_prefix)  # MTP modules if it holds them
        rules = row.tensor_rules(cfg, row, rope_layout)
        names = _resolve(reader, rules, row, folder)
        loaders = _leaf_loaders(rules, reader, names)
        if scan_layers:
            for prefix, stack in layer_stacks(cfg):  # the top level, or encoder/ and decoder/
                loaders = _stacked(loaders, stack.layer_runs, prefix)
        expected = by_path(param_shapes(cfg))
        assert set(loaders) == set(expected), (sorted(loaders), sorted(expected))
        if callable(shardings) and not isinstance(shardings, jax.sharding.Sharding):
            shardings = shardings(cfg)
        placement = _shardings_for(shardings, expected)
        params = {}
        for p, load in loaders.items():
            host = np.asarray(load()).astype(jnp.dtype(cfg.param_dtype), copy=False)
            assert host.shape == expected[p].shape, (p, host.shape, expected[p].shape)
            params[p] = _place(host, placement[p])
    finally:
        reader.close()
    return cfg, _unflatten(params)


def _leaf_loaders(rules, reader: SafetensorsReader, names) -> dict[Path, Callable]:
    """param path -> a function reading its group's HF tensors (the last group is kept, so
    GPT-2's fused q|k|v is read once for query, key and value)."""
    last: dict[int, tuple] = {}

    def group(i):
        if i not in last:
            last.clear()
            last[i] = rules[i].to_ours(*[reader.read(names[n]) for n in rules[i].hf])
        return last[i]

    return {path: (lambda i=i, j=j: group(i)[j])
            for i, rule in enumerate(rules) for j, path in enumerate(rule.ours)}


def _stacked(loaders: dict[Path, Callable], runs, prefix: Path = ()) -> dict[Path, Callable]:
    """prefix/block_i/... loaders -> prefix/blocks/... loaders stacking each run's layers
    (host memory: one stacked param at a time)."""
    n = len(prefix)
    layer = lambda path: path[n] if path[:n] == prefix else ""  # noqa: E731
    out = {path: load for path, load in loaders.items() if not layer(path).startswith("block_")}
    for run in runs:
        for path in loaders:
            if layer(path) == f"block_{run.start}":
                out[prefix + (run.name,) + path[n + 1:]] = \
                    lambda rest=path[n + 1:], run=run: np.stack(
                        [loaders[prefix + (f"block_{i}",) + rest]()
                         for i in range(run.start, run.stop)])
    return out


def _place(host: np.ndarray, sharding):
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
