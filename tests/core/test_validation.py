"""jaxformer.core.validation: the checks refuse random bad values with one line naming the
field (owner.name), the value and what is accepted, and accept good ones; build_section
coerces strings to each field's type and refuses unknown keys naming the valid ones;
parse_overrides and merge build the nested mapping the sections are read from. (Annotations
are postponed, as in the config modules: type_names reads them as text.)"""

from __future__ import annotations

import dataclasses

import pytest

from jaxformer.core.validation import (ConfigError, Section, build_section, check_choice,
                                       check_number, coerce, merge, parse_overrides)


def one_line(e):
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_check_choice_names_the_field_the_value_and_every_allowed_one(rng):
    allowed = [f"opt{i}" for i in rng.permutation(6)[:int(rng.integers(2, 6))]]
    for value in allowed:
        check_choice("model", "kind", value, allowed)
    bad = f"bad{int(rng.integers(1000))}"
    with pytest.raises(ConfigError) as e:
        check_choice("model", "kind", bad, {a: 0 for a in allowed})  # a table's keys
    assert one_line(e) == f"model.kind={bad!r} is not one of {', '.join(allowed)}"


def test_check_number_bounds_types_and_none(rng):
    low, high = sorted(rng.integers(-50, 50, size=2).tolist())
    high += 1
    for _ in range(20):  # inside: accepted, as an int and (kind float) as a float too
        x = int(rng.integers(low, high + 1))
        check_number("optim", "n", x, int, low=low, high=high)
        check_number("optim", "n", x + 0.5 * (x < high), float, low=low, high=high)
    cases = [(low - int(rng.integers(1, 9)), {}, f">= {low}"),
             (high + int(rng.integers(1, 9)), {}, f"<= {high}"),
             (low, {"low_open": True}, f"> {low}"), (high, {"high_open": True}, f"< {high}")]
    for value, kw, says in cases:
        with pytest.raises(ConfigError) as e:
            check_number("optim", "n", value, int, low=low, high=high, **kw)
        assert one_line(e) == f"optim.n={value!r} must be {says}"
    for value, kind, says in [(True, int, "an int"), (1.5, int, "an int"), ("3", float, "a number"),
                              (None, int, "an int"), (False, float, "a number")]:
        with pytest.raises(ConfigError) as e:
            check_number("train", "x", value, kind)
        assert one_line(e) == f"train.x={value!r} must be {says}"
    check_number("train", "x", None, int, optional=True)
    with pytest.raises(ConfigError, match=r"^train.x='a' must be an int or None$"):
        check_number("train", "x", "a", int, optional=True)


@dataclasses.dataclass(frozen=True)
class Inner:
    kind: str = "none"
    factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class Sec(Section):
    steps: int = 1
    lr: float = 1e-3
    name: str = "x"
    flag: bool = False
    limit: int | None = None
    inner: dict | None = None

    SECTION = "train"


def test_build_section_coerces_strings_to_each_fields_type(rng):
    steps, lr = int(rng.integers(1, 10**6)), float(rng.uniform(1e-6, 1))
    got = build_section(Sec, {"steps": str(steps), "lr": repr(lr), "name": 2024, "flag": "on",
                              "limit": "none", "inner": {"kind": "yarn", "factor": "4"}},
                        "train", nested={"inner": Inner})
    assert got == Sec(steps=steps, lr=lr, name="2024", flag=True, limit=None,
                      inner={"kind": "yarn", "factor": 4.0})
    assert build_section(Sec, {"lr": 3, "flag": "no"}, "train") == Sec(lr=3.0, flag=False)
    assert isinstance(coerce(3, "float", "k"), float) and coerce(3, "int | float", "k") == 3
    assert Sec.from_dict(got.to_dict()) == got
    assert got.replace(steps=7).steps == 7


def test_build_section_refuses_bad_values_and_unknown_keys_in_one_line():
    for raw, says in [({"steps": "ten"}, "train.steps='ten' must be an int"),
                      ({"lr": "fast"}, "train.lr='fast' must be a number"),
                      ({"flag": "maybe"}, "train.flag='maybe' must be true or false")]:
        with pytest.raises(ConfigError) as e:
            build_section(Sec, raw, "train")
        assert one_line(e) == says
    with pytest.raises(ConfigError) as e:
        build_section(Sec, {"stepz": 1, "lr": 1.0}, "train", extra=" (or see docs)")
    assert one_line(e) == ("unknown key(s) train.stepz; valid train keys are: steps, lr, name, "
                           "flag, limit, inner (or see docs)")
    with pytest.raises(ConfigError) as e:
        build_section(Sec, {"inner": {"knd": "x"}}, "train", nested={"inner": Inner})
    assert one_line(e) == "unknown key(s) train.inner.knd; valid keys are: kind, factor"
    for call in (lambda: Sec.from_dict({"bogus": 1}), lambda: Sec().replace(bogus=1)):
        with pytest.raises(ConfigError) as e:
            call()
        assert one_line(e).startswith("unknown train field(s) bogus; valid fields are: steps, lr")


def test_overrides_nest_by_dotted_key_and_merge_on_top():
    got = parse_overrides(["train.steps=10", "model.rope.kind=yarn", "train.p= a=b "],
                          ("train", "model"))
    assert got == {"train": {"steps": "10", "p": " a=b "}, "model": {"rope": {"kind": "yarn"}}}
    base = {"train": {"steps": 1, "lr": 2}, "model": {"rope": {"kind": "x", "f": 2}}, "data": 3}
    assert merge(base, got) == {"train": {"steps": "10", "lr": 2, "p": " a=b "}, "data": 3,
                                "model": {"rope": {"kind": "yarn", "f": 2}}}
    assert base["train"] == {"steps": 1, "lr": 2}  # not changed in place
    for items, says in [(["train.steps"], "is not key=value"),
                        (["optim.lr=1"], "must be section.field with section one of: train, model"),
                        (["steps=1"], "must be section.field")]:
        with pytest.raises(ConfigError, match=says):
            parse_overrides(items, ("train", "model"))
