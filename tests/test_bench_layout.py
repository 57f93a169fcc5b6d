"""bench/ keeps the library's house rules (tests/test_layout.py applies them to jaxformer/):
no file past 400 lines, no function past 60 (past that it holds two ideas: split it by
stage), and no variant compared by its name in an ==/in (ask the variant's table)."""

import ast
import functools
import pathlib

from tests.test_layout import compared_literals, variant_tables

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def scripts() -> list[pathlib.Path]:
    return sorted(BENCH.rglob("*.py"))


def long_files(paths) -> dict[str, int]:
    """{path: lines} of the files past MAX_FILE_LINES."""
    return {str(p): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}


def long_functions(paths) -> dict[str, int]:
    """{path:name: lines} of the functions (nested ones too) past MAX_FUNCTION_LINES."""
    return {f"{p}:{node.name}": node.end_lineno - node.lineno + 1
            for p in paths for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}


@functools.cache
def variant_names() -> dict[str, str]:
    """{variant name: the config field it answers}: every entry of test_layout's tables
    (schemes, backends, objectives, optimizers, archs, data formats, tokenizer kinds, ...);
    "none" left out (also the word for no value)."""
    names = {n: field for field, table in variant_tables().items() for n in table}
    names.pop("none", None)
    return names


def variant_compares(paths) -> list[str]:
    """path:line: the ==, !=, in or not in that compares with a variant's name."""
    names = variant_names()
    found = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            hits = sorted({f"{s}: {names[s]}" for s in compared_literals(node) if s in names}) \
                if isinstance(node, ast.Compare) else []
            if hits:
                found.append(f"{p}:{node.lineno}: {ast.unparse(node)} ({', '.join(hits)})")
    return found


def test_bench_files_and_functions_hold_one_idea():
    assert scripts(), BENCH
    assert not long_files(scripts()), long_files(scripts())
    assert not long_functions(scripts()), long_functions(scripts())


def test_no_bench_script_compares_a_variant_by_name():
    found = variant_compares(scripts())
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_forbid(tmp_path, rng):
    """Generated scripts at random lengths around the limits: exactly the file past 400
    lines and the functions (a nested one too) past 60 are named, and a comparison with
    each kind of variant name (a position scheme, a backend, an optimizer, an objective,
    an arch, a data format, a tokenizer kind) is found, a tuple's member too; comparing
    with a name that is no variant is not."""
    def function(name, lines, indent=""):
        return [f"{indent}def {name}():"] + [f"{indent}    x = {i}" for i in range(lines - 1)]

    over, under = [int(n) for n in rng.integers(61, 90, 2)], int(rng.integers(2, 61))
    script = tmp_path / "script.py"
    script.write_text("\n".join(function("short", under) + function("long", over[0])
                                + function("outer", 3) + function("inner", over[1], "    ")
                                + function("at_limit", MAX_FUNCTION_LINES)) + "\n")
    assert long_functions([script]) == {f"{script}:long": over[0],
                                        f"{script}:outer": 3 + over[1],  # its body holds inner
                                        f"{script}:inner": over[1]}
    sizes = {tmp_path / f"f{i}.py": int(n) for i, n in enumerate(rng.integers(300, 500, 4))}
    sizes[tmp_path / "at_limit.py"] = MAX_FILE_LINES
    for path, n in sizes.items():
        path.write_text("x = 1\n" * n)
    assert long_files(sizes) == {str(p): n for p, n in sizes.items() if n > MAX_FILE_LINES}

    names = variant_names()
    kinds = {kind: sorted(n for n, k in names.items() if k == kind)
             for kind in ("position", "attention_impl", "optim.name", "objective.name",
                          "model.arch", "data.format", "data.tokenizer")}
    assert all(kinds.values()), kinds  # every table is found
    compares = tmp_path / "compares.py"
    picks = [str(rng.choice(k)) for k in kinds.values()]
    compares.write_text("".join(f"a = x == {n!r}\nb = x in ('not a variant', {n!r})\n"
                                for n in picks) + "c = x == 'not a variant'\n")
    assert [line.split(": ")[0] for line in variant_compares([compares])] == \
        [f"{compares}:{i}" for i in range(1, 2 * len(picks) + 1)]
