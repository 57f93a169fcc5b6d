"""jaxformer.core.validation: the checks refuse random bad values with one line naming the
field (owner.name), the value and what is accepted, and accept good ones; build_section
coerces strings to each field's type and refuses unknown keys naming the valid ones;
parse_overrides and merge build the nested mapping the sections are read from. (Annotations
are postponed, as in the config modules: type_names reads them as text.)"""

from __future__ import annotations

import dataclasses

import pytest

from jaxformer.core.validation import (ConfigError, Section, build_section, check_choice,
                                       check_number, coerce, merge, parse_overrides,
                                       read_config_file)


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


def test_check_number_refuses_nan_and_infinities_in_every_range():
    for value in (float("nan"), float("inf"), float("-inf")):
        for kw in ({}, {"low": 0}, {"low": 0, "high": 1, "high_open": True}, {"optional": True}):
            with pytest.raises(ConfigError) as e:
                check_number("optim", "lr", value, float, **kw)
            assert one_line(e) == f"optim.lr={value!r} must be a finite number"
    assert coerce("nan", "float", "optim.lr") != coerce("nan", "float", "optim.lr")  # read,
    with pytest.raises(ConfigError, match=r"^optim.lr=nan must be a finite number$"):
        check_number("optim", "lr", coerce("nan", "float", "optim.lr"), float, low=0)  # refused


def test_a_list_or_mapping_for_a_scalar_field_and_a_number_for_a_list_field_are_one_line():
    @dataclasses.dataclass(frozen=True)
    class Shaped:
        run_dir: str = "runs/x"
        pattern: tuple[str, ...] = ()
        layers: tuple[int, ...] | None = None
        mixture: str | None = None  # an optional field checks itself: data.mixture takes a list
    for raw, says in [({"run_dir": ["a"]}, "train.run_dir=['a'] must be a string"),
                      ({"run_dir": {"a": 1}}, "train.run_dir={'a': 1} must be a string"),
                      ({"pattern": 5}, "train.pattern=5 must be a list (a,b on the command line)"),
                      ({"pattern": None}, "train.pattern=None must be a list"),
                      ({"layers": {"a": 1}}, "train.layers={'a': 1} must be a list")]:
        with pytest.raises(ConfigError) as e:
            build_section(Shaped, raw, "train")
        assert one_line(e).startswith(says), one_line(e)
    for raw, field in [({"steps": [1]}, "an int"), ({"lr": [1.0]}, "a number"),
                       ({"flag": {"x": 1}}, "true or false")]:
        with pytest.raises(ConfigError, match=f"must be {field}$"):
            build_section(Sec, raw, "train")
    got = build_section(Shaped, {"pattern": ["a"], "layers": 3, "mixture": ["a:1", "b:2"]}, "train")
    assert got.pattern == ["a"] and got.layers == 3 and got.mixture == ["a:1", "b:2"]
    with pytest.raises(ConfigError) as e:  # unhashable: not one of them, not a TypeError
        check_choice("model", "position", ["rope"], {"rope": 0, "alibi": 1})
    assert one_line(e) == "model.position=['rope'] is not one of rope, alibi"
    with pytest.raises(ConfigError) as e:  # a YAML key that is a number
        build_section(Sec, {1: 2}, "train")
    assert one_line(e).startswith("unknown key(s) train.1; valid train keys are: steps")


def test_a_key_given_twice_in_a_config_file_is_refused_naming_it_and_both_lines(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("train:\n  steps: 3\nmodel:\n  n_layers: 1\ntrain:\n  steps: 2\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert one_line(e) == (f"config file {path} is not valid YAML: line 5, column 1: duplicate "
                           "key 'train' (first at line 1); keep one")
    path.write_text("model:\n  d_model: 8\n  n_layers: 1\n  d_model: 16\n")  # nested too
    with pytest.raises(ConfigError, match="line 4, column 3: duplicate key 'd_model' .first at "
                                          "line 2."):
        read_config_file(str(path))
    path.write_text("base: &b\n  steps: 3\n  seed: 1\ntrain:\n  <<: *b\n  steps: 4\n")
    assert read_config_file(str(path))["train"] == {"steps": 4, "seed": 1}  # a merge: overridable
    path.write_text("train: !!python/object/apply:os.system [echo]\n")  # still safe
    with pytest.raises(ConfigError, match="is not valid YAML: line 1, column 8: "):
        read_config_file(str(path))


def test_a_config_file_that_is_not_utf8_or_not_yaml_is_one_line_naming_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"train:\n  run_dir: caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert one_line(e) == (f"config file {path} is not UTF-8 text (line 2: byte 0xe9); "
                           "save it as UTF-8")
    path.write_text("train:\n  steps: [3\nmodel: 1\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert one_line(e) == (f"config file {path} is not valid YAML: line 3, column 6: expected "
                           "',' or ']', but got ':' (while parsing a flow sequence)")
    path.write_text("train:\n\tsteps: 3\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert one_line(e).startswith(f"config file {path} is not valid YAML: line 2, column 1: ")
