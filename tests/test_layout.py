"""The house rules of jaxformer/, read from its source: no import circle, files and
functions of one idea each, and every axis of variation named in its table alone."""

import ast
import pathlib
import re

import pytest

from jaxformer.backends import BACKENDS
from jaxformer.data.sources import SOURCES
from jaxformer.schemes import POSITION_SCHEMES

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxformer"
MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: pathlib.Path) -> set[str]:
    """The jaxformer modules a module imports, at its top or inside a function."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in found if m in MODULES and m != name}


def test_no_import_circle():
    """A lower layer never imports a higher one: the import graph of jaxformer's modules,
    function-level imports included, has no cycle (the package __init__s, which only
    gather names for users, are left out)."""
    graph = {m: imports(m, p) - {"jaxformer"} for m, p in MODULES.items()}
    graph = {m: {d for d in deps if not MODULES[d].name == "__init__.py"}
             for m, deps in graph.items() if MODULES[m].name != "__init__.py"}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycle = path[path.index(d):] + [d]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_files_and_functions_hold_one_idea():
    """No file of jaxformer/ past 400 lines, no function past 60: past that it holds two
    ideas (split it by stage)."""
    long_files = {str(p.relative_to(PACKAGE)): n for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > 400}
    long_functions = {}
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > 60:
                long_functions[f"{p.relative_to(PACKAGE)}:{node.name}"] = \
                    node.end_lineno - node.lineno + 1
    assert not long_files and not long_functions, (long_files, long_functions)


def literal_lines(name: str) -> list[str]:
    """The lines of jaxformer/ that hold `name` as a string literal; not convert/,
    experiments/ or presets.py, which name schemes as data (HF families, the studies'
    choices, released configurations)."""
    pattern = re.compile(r"""(?<![\w.])(["'])%s\1""" % re.escape(name))
    return [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
            for p in MODULES.values() if p.relative_to(PACKAGE).parts[0] not in
            ("convert", "experiments", "presets.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


# "none" (NoPE) is also the no-op value of remat and rope_scaling, their own tables' word
@pytest.mark.parametrize("name", [n for n in [*POSITION_SCHEMES, *BACKENDS] if n != "none"])
def test_each_variant_is_named_in_its_table_alone(name):
    """A positional scheme or attention backend is named as a string on at most two lines
    of the library (its table entry and at most one default): the rest of the code asks
    the table what the variant does. "sandwich" is also a block flow (Gemma's sandwich
    norm), named in that table and its list of choices."""
    from jaxformer.layers import BLOCK_FLOWS
    lines = [line for line in literal_lines(name) if name not in BLOCK_FLOWS or
             not line.startswith(("layers.py", "config.py"))]
    assert 1 <= len(lines) <= 2, lines


def test_the_tables_list_what_the_tests_parametrise_over():
    """The tables are what config validation accepts, so a new entry is a valid value."""
    from jaxformer import ModelConfig
    for name in POSITION_SCHEMES:
        assert ModelConfig(position=name, d_model=32, n_heads=4).position == name
    for name, backend in BACKENDS.items():
        if backend.takes_bias:
            assert ModelConfig(attention_impl=name, position="alibi").attention_impl == name
    assert set(SOURCES) >= {"files", "jsonl", "parquet", "bin", "bin_pair", "prepared"}
