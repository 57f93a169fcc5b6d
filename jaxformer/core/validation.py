"""Config validation shared by every config section (model, data, optim, train, ...):
one error type whose message names the field and what it accepts, the checks that
produce it, the mapping round trip of a frozen dataclass section, and sections read from
YAML (yaml.safe_load) with dotted key=value overrides typed by the fields they set."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Hashable, Mapping

import yaml


class ConfigError(ValueError):
    """A config field has a bad value; the message names the field and what it accepts."""


def check_choice(owner: str, name: str, value: Any, allowed) -> None:
    """value must be one of `allowed` (any iterable of names, e.g. a table's keys)."""
    try:
        known = value in allowed
    except TypeError:  # unhashable: a list or mapping from YAML
        known = False
    if not known:
        raise ConfigError(f"{owner}.{name}={value!r} is not one of {', '.join(allowed)}")


def check_number(owner: str, name: str, value: Any, kind: type, *, low=None, low_open=False,
                 high=None, high_open=False, optional=False) -> None:
    """value must be an int (kind int) or a finite number (kind float) within the bounds;
    None too when optional. Booleans, NaN and infinities are refused."""
    if value is None and optional:
        return
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{owner}.{name}={value!r} must be {'an int' if kind is int else 'a number'}"
                          f"{' or None' if optional else ''}")
    if not math.isfinite(value):  # NaN fails every comparison below
        raise ConfigError(f"{owner}.{name}={value!r} must be a finite number")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(f"{owner}.{name}={value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ConfigError(f"{owner}.{name}={value!r} must be {'<' if high_open else '<='} {high}")


def as_section(cls, value: Any, key: str):
    """value as the dataclass cls (a Section): a mapping built into one (cls.from_dict), an
    instance as it is; anything else (an empty YAML section is None) refused in one line."""
    if isinstance(value, Mapping):
        return cls.from_dict(value)
    if isinstance(value, cls):
        return value
    fields = ", ".join(f.name for f in dataclasses.fields(cls)[:2])
    raise ConfigError(f"{key} must be a mapping of its fields ({fields}, ...); got {value!r}")


def reject_unknown(cls, keys, owner: str) -> None:
    """Every key must be a field of the dataclass `cls`; the error lists the valid ones."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in set(keys) - set(names))  # YAML keys may be numbers
    if unknown:
        raise ConfigError(f"unknown {owner} field(s) {', '.join(unknown)}; "
                          f"valid fields are: {', '.join(names)}")


def from_mapping(cls, values: Mapping[str, Any], owner: str):
    """cls(**values), unknown keys refused first."""
    reject_unknown(cls, values, owner)
    return cls(**values)


class Section:
    """A frozen dataclass config section named `SECTION` (its fields are `SECTION.name`
    in messages and on the command line): built from a mapping with unknown keys refused,
    written back as one, replaced field by field with the same checks."""

    SECTION = "config"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """Build from a plain mapping (YAML, JSON); unknown keys are an error."""
        return from_mapping(cls, values, cls.SECTION)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes):
        reject_unknown(type(self), changes, self.SECTION)
        return dataclasses.replace(self, **changes)


# ---- sections from YAML and the command line ---------------------------------------


def type_names(cls) -> dict[str, str]:
    """Field name -> its annotation as text ('int | None'); the config modules use
    postponed annotations, so the text is what the source says."""
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__
            for f in dataclasses.fields(cls)}


# a scalar field's type -> what its value must be, in messages
SCALARS = {"str": "a string", "int": "an int", "float": "a number", "bool": "true or false"}


def check_shape(value: Any, type_name: str, key: str) -> None:
    """A list or mapping for a scalar field (str, int, float, bool), or for a list field
    (tuple[...]) anything but a list (a tuple[int, ...] also takes one int), in one line.
    An optional scalar (`str | None`) is left to its field's own check: one of them,
    data.mixture, takes a YAML list too."""
    kinds = [k for k in type_name.split(" | ") if k != "None"]
    kind = kinds[0] if len(kinds) == 1 else ""
    if type_name in SCALARS and isinstance(value, (list, tuple, set, Mapping)):
        raise ConfigError(f"{key}={value!r} must be {SCALARS[type_name]}")
    if kind.startswith("tuple[") and not (value is None and "None" in type_name) and \
            not isinstance(value, (str, list, tuple)) and \
            not (kind.startswith("tuple[int") and isinstance(value, int)):
        raise ConfigError(f"{key}={value!r} must be a list (a,b on the command line)")


def coerce(value: Any, type_name: str, key: str) -> Any:
    """Strings from YAML or the command line to the field's type ('3e-4' -> 0.0003); a
    value of the wrong shape (check_shape) is refused."""
    check_shape(value, type_name, key)
    if value is None or not isinstance(value, str):
        if isinstance(value, int) and not isinstance(value, bool) and "float" in type_name \
                and "int" not in type_name:
            return float(value)
        if type_name.startswith("str") and isinstance(value, (int, float)) and \
                not isinstance(value, bool):
            return str(value)  # YAML read `run_dir: 2024` as a number
        return value
    if value.lower() in ("none", "null", "~") and "None" in type_name:
        return None
    if type_name.startswith("tuple"):  # 'a,b' from the command line: the field splits it
        return value
    try:
        if "int" in type_name and "float" not in type_name:
            return int(value)
        if "float" in type_name:
            return float(value)
    except ValueError:
        kind = "an int" if "int" in type_name and "float" not in type_name else "a number"
        raise ConfigError(f"{key}={value!r} must be {kind}") from None
    if "bool" in type_name:
        if value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def check_keys(raw: Mapping[str, Any], valid, section: str, extra: str = "") -> None:
    """Every key of raw must be one of `valid`; the error names the unknown ones as
    section.key and lists the valid ones (and `extra`)."""
    unknown = sorted(str(k) for k in set(raw) - set(valid))  # YAML keys may be numbers
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; valid "
                          f"{section} keys are: {', '.join(valid)}{extra}")


def build_section(cls, raw: Mapping[str, Any], section: str, *, nested=None, extra: str = ""):
    """cls from raw values, each coerced to its field's type; nested: field name -> the
    dataclass a mapping value of that field is checked and coerced against
    (model.rope_scaling). Unknown keys are refused, naming the valid ones (and `extra`)."""
    types, nested = type_names(cls), nested or {}
    check_keys(raw, types, section, extra)
    values = {}
    for key, value in raw.items():
        if key in nested and isinstance(value, Mapping):
            inner = type_names(nested[key])
            bad = sorted(str(k) for k in set(value) - set(inner))
            if bad:
                raise ConfigError(f"unknown key(s) {', '.join(f'{section}.{key}.{b}' for b in bad)}"
                                  f"; valid keys are: {', '.join(inner)}")
            value = {k: coerce(v, inner[k], f"{section}.{key}.{k}") for k, v in value.items()}
        else:
            value = coerce(value, types[key], f"{section}.{key}")
        values[key] = value
    return cls(**values)


def parse_overrides(items: list[str], sections) -> dict[str, dict[str, Any]]:
    """['train.steps=10', 'model.rope_scaling.kind=yarn'] -> nested mapping of the value
    strings, exactly as typed (a trailing space in train.sample_prompt stays); the first
    part of each key must be one of `sections`."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in sections:
            raise ConfigError(f"override key {key!r} must be section.field with section one of: "
                              f"{', '.join(sections)}")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} sets a field inside a non-mapping value")
        node[parts[-1]] = value  # a string: coerce gives it its field's type
    return out


def merge(base: Mapping, extra: Mapping) -> dict:
    """base with extra's values on top, mappings merged key by key."""
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = merge(merged[k], v) if isinstance(v, Mapping) and isinstance(
            merged.get(k), Mapping) else v
    return merged


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader (plain data only) that refuses a key given twice in one
    mapping, naming it and both lines, instead of keeping the last silently."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error: found unhashable key
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]}); keep one",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A PyYAML error in one line: line and column (1-based) and the problem."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    context = f" ({e.context})" if getattr(e, "context", None) else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{context}"


def read_config_file(path: str | None, example: str = "configs/tiny.yaml") -> dict[str, Any]:
    """The mapping of sections in a YAML config file (safe: plain data only; a key given
    twice is an error); {} for None."""
    if path is None:
        return {}
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist; configs live in configs/, "
                          f"e.g. {example}")
    data = p.read_bytes()
    try:
        raw = yaml.load(data.decode("utf-8"), Loader=UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}: byte "
                          f"{data[e.start]:#04x}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections; got {raw!r}")
    return raw
