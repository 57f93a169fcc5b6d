"""The house rules of jaxformer/, read from its source: no import circle, files and
functions of one idea each, and every axis of variation named in its table alone."""

import ast
import functools
import pathlib
import re

import pytest

from jaxformer.attention.backends import BACKENDS
from jaxformer.data.sources import SOURCES
from jaxformer.positions.schemes import POSITION_SCHEMES

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxformer"
MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PACKAGE.rglob("*.py")}


@functools.cache
def syntax(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test here."""
    return ast.parse(path.read_text())


def imports(name: str, path: pathlib.Path) -> set[str]:
    """The jaxformer modules a module imports, at its top or inside a function."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(syntax(path)):
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


def module_graph() -> dict[str, set[str]]:
    """module -> the modules it imports, function-level imports included (the package
    __init__s, which only gather names for users, are left out)."""
    graph = {m: imports(m, p) - {"jaxformer"} for m, p in MODULES.items()}
    return {m: {d for d in deps if not MODULES[d].name == "__init__.py"}
            for m, deps in graph.items() if MODULES[m].name != "__init__.py"}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (its nodes in order, the first again at the end), or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = "done"

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_circle():
    """A lower layer never imports a higher one: the import graph of jaxformer's modules
    has no cycle."""
    found = circle(module_graph())
    assert found is None, "import circle: " + " -> ".join(found)


def package_of(module: str) -> str:
    """jaxformer.training.loop -> training; a top module (jaxformer.model.transformer) is its own."""
    return (module.split(".") + [""])[1]


def test_no_package_circle():
    """Nor do the packages: with each subpackage of jaxformer/ one node (its modules
    together) and each top module one, the imports between them have no cycle. A
    wing's __main__ is a command line (see wing_arrows), no part of its wing."""
    graph = {}
    for m, deps in module_graph().items():
        if m.endswith(".__main__"):
            m = m.replace(".", "_")  # a node of its own, at the top
        graph.setdefault(package_of(m), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(m))
    found = circle(graph)
    assert found is None, "package circle: " + " -> ".join(found)


# The wings of jaxformer/, bottom up: a wing imports only wings before it in this list.
WINGS = (
    "core",         # validation, sharding, host memory, hooks, matmul, log-probs, reference math
    "positions",    # positional math, the scheme table, RoPE scalings
    "attention",    # backends and their rules, kernels, masks, the KV cache, MLA's math
    "recurrent",    # the recurrent mixers' math: gated delta rule, SSD, short convolutions
    "moe",          # routers, dispatches, grouped matmuls, expert parallelism, balancing
    "model",        # ModelConfig, the kind tables, the Flax modules, presets, LoRA, quantize
    "decode",       # sampling, constraints, the cached forward, loops, speculative, seq2seq
    "serve",        # the continuous-batching engine over a paged KV cache
    "hf",           # one row per Hugging Face model type: read and write folders
    "data",         # tokenizers, sources, mixtures, batches
    "training",     # the loop, objectives, optimizers, checkpoints, saved runs
    "eval",         # the lm-evaluation-harness model
    "convert",      # the import/export CLI
    "experiments",  # the positional studies and the tasks they run
)
ENTRIES = ("generate",)  # the CLIs at the top level: they may import any wing, none imports them


def wing_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports that break the wings' order: a wing importing a later one (or an entry
    module), or a module at the top level that is neither __init__ nor an entry. A wing's
    __main__ (python -m jaxformer.serve) is a command line, as the entries are: it may
    load a run or a folder through any wing."""
    rank = {w: i for i, w in enumerate(WINGS)}
    wrong = [f"{m}: a module at the top of jaxformer/ (put it in a wing)"
             for m in graph if package_of(m) not in rank and package_of(m) not in ENTRIES]
    for m, deps in graph.items():
        if m.endswith(".__main__"):
            continue
        for d in sorted(deps):
            a, b = package_of(m), package_of(d)
            if a != b and a in rank and (b not in rank or rank[b] > rank[a]):
                wrong.append(f"{m} -> {d} ({a} sits below {b} in tests/test_layout.py WINGS)")
    return wrong


def test_each_wing_imports_only_the_wings_below_it():
    """The layout list above is the rule: no wing imports a wing after it, nor a CLI, and
    the top of jaxformer/ holds only the wings, __init__.py and the CLIs."""
    assert not wing_arrows(module_graph()), "\n".join(wing_arrows(module_graph()))
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(WINGS), folders ^ set(WINGS)


def test_the_wing_rule_catches_an_upward_import():
    """A planted import of a higher wing (core importing model) is named by the rule."""
    graph = module_graph()
    planted = {**graph, "jaxformer.core.matmul": graph["jaxformer.core.matmul"] |
               {"jaxformer.model.config"}}
    assert any("jaxformer.core.matmul -> jaxformer.model.config" in w
               for w in wing_arrows(planted))


def test_training_reads_hf_folders_without_the_converter():
    """training/ starts runs from Hugging Face folders through jaxformer.hf and never
    imports jaxformer.convert, which sits above it (its CLI makes and reads training runs)."""
    arrows = [f"{m} -> {d}" for m, p in MODULES.items() if package_of(m) == "training"
              for d in sorted(imports(m, p)) if d.split(".")[:2] == ["jaxformer", "convert"]]
    assert not arrows, arrows


# one row per Hugging Face model_type: in families.py, or in a layout module's ROWS (the
# families since the hybrids), or the multimodal folders' (hf/multimodal.py)
ROWS = {PACKAGE / "hf" / "families.py", PACKAGE / "hf" / "multimodal.py"} | {
    p for p in (PACKAGE / "hf").glob("*_layout.py") if re.search(r"^ROWS\b", p.read_text(), re.M)}


def test_model_types_are_named_in_their_rows_alone():
    """A Hugging Face model_type (a row of jaxformer.hf.families, or a model type it
    refuses by name) is a string literal in the rows' module alone, and nothing in
    jaxformer/ compares a value with one (==, !=, in, not in): the code asks the row. A
    name that is also a position scheme's (t5) or a mixer's (mamba2) may stand as a literal,
    where it names the scheme (model.position="t5") or the mixer."""
    from jaxformer.hf.families import MODEL_TYPES, OTHER_MODEL_TYPES
    from jaxformer.model.mixers import MIXERS
    from jaxformer.positions.schemes import POSITION_SCHEMES
    names = set(MODEL_TYPES) | set(OTHER_MODEL_TYPES)
    literal_names = names - set(POSITION_SCHEMES) - set(MIXERS)
    found = []
    for path in MODULES.values():
        where = path.relative_to(PACKAGE)
        for node in ast.walk(syntax(path)):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [c.value for side in sides for c in [side, *getattr(side, "elts", [])]
                         if isinstance(c, ast.Constant) and c.value in names]
                if named and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                 for op in node.ops):
                    found.append(f"{where}:{node.lineno}: compares with {named}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value in literal_names and path not in ROWS:
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_files_and_functions_hold_one_idea():
    """No file of jaxformer/ past 400 lines, no function past 60: past that it holds two
    ideas (split it by stage)."""
    long_files = {str(p.relative_to(PACKAGE)): n for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > 400}
    long_functions = {}
    for p in MODULES.values():
        for node in ast.walk(syntax(p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > 60:
                long_functions[f"{p.relative_to(PACKAGE)}:{node.name}"] = \
                    node.end_lineno - node.lineno + 1
    assert not long_files and not long_functions, (long_files, long_functions)


def literal_lines(name: str) -> list[str]:
    """The lines of jaxformer/ that hold `name` as a string literal; not hf/, convert/,
    experiments/ or model/presets.py, which name schemes as data (HF families, the studies'
    choices, released configurations)."""
    pattern = re.compile(r"""(?<![\w.])(["'])%s\1""" % re.escape(name))
    return [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
            for p in MODULES.values() if p.relative_to(PACKAGE).parts[0] not in
            ("hf", "convert", "experiments") and p.relative_to(PACKAGE).as_posix() != "model/presets.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


# "none" (NoPE) is also the no-op value of remat and rope_scaling, their own tables' word
@pytest.mark.parametrize("name", [n for n in [*POSITION_SCHEMES, *BACKENDS] if n != "none"])
def test_each_variant_is_named_in_its_table_alone(name):
    """A positional scheme or attention backend is named as a string on at most two lines
    of the library (its table entry and at most one default): the rest of the code asks
    the table what the variant does. "sandwich" is also a block flow (Gemma's sandwich
    norm), named in that table (jaxformer/model/kinds.py)."""
    from jaxformer.model.kinds import BLOCKS
    lines = [line for line in literal_lines(name) if name not in BLOCKS or
             not line.startswith("model/kinds.py")]
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


def variant_tables() -> dict[str, dict]:
    """Every table of variants in the library, by the config field it answers."""
    from jaxformer.model import kinds
    from jaxformer.positions.rope_scaling import ROPE_SCALINGS
    from jaxformer.positions.schemes import SINUSOIDAL_SCALES
    from jaxformer.data.formats import FORMATS
    from jaxformer.data.tokenizer_kinds import TOKENIZERS
    from jaxformer.model.archs import ARCHS
    from jaxformer.model.mixers import MIXERS
    from jaxformer.training.objectives import OBJECTIVES
    from jaxformer.training.objectives.preference import LOSSES
    from jaxformer.training.optim import OPTIMIZERS, SCHEDULES
    return {"position": POSITION_SCHEMES, "attention_impl": BACKENDS,
            "rope_scaling.kind": ROPE_SCALINGS, "norm": kinds.NORMS, "ffn": kinds.FFNS,
            "block": kinds.BLOCKS, "qk_norm": kinds.QK_NORMS, "remat": kinds.REMATS,
            "position_settings.scale": SINUSOIDAL_SCALES, "data source": SOURCES,
            "model.arch": ARCHS, "objective.name": OBJECTIVES, "objective.loss": LOSSES,
            "optim.name": OPTIMIZERS, "optim.schedule": SCHEDULES, "data.format": FORMATS,
            "data.tokenizer": TOKENIZERS, # attention and none: words of other fields too (HF rows' biases)
            "layer_kinds.<kind>.mixer": {n: m for n, m in MIXERS.items() if m.recurrent}}


def string_constants() -> dict[str, str]:
    """The module-level string constants of jaxformer/ (ENCODER_DECODER = "encoder_decoder"):
    comparing with one is comparing with its value."""
    found = {}
    for p in MODULES.values():
        for node in syntax(p).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                found |= {t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)}
    return found


def compared_literals(node: ast.Compare, constants: dict[str, str] = {}) -> list[str]:
    """The strings an ==, !=, in or not in compares with (alone or in a tuple): literals,
    and names of the string `constants`."""
    if not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
        return []
    found = []
    for side in (node.left, *node.comparators):
        items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        found += [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        found += [constants[i.id] for i in items if isinstance(i, ast.Name) and i.id in constants]
    return found


def test_no_variant_is_compared_by_name():
    """No `==`/`in` compares a value with a variant's name, written out or through a
    constant (a positional scheme, backend, RoPE scaling, norm, FFN, block flow, QK-norm,
    remat policy, sinusoidal scale, data source, model arch, objective, preference loss,
    optimizer, schedule, data format or tokenizer kind) anywhere in jaxformer/ or train.py
    (bench/: tests/test_bench_layout.py): the code asks the variant's table row what it
    does. "none" is also the word for no value in parsed text, so it is left to the tables'
    own tests."""
    names = {n: field for field, table in variant_tables().items() for n in table}
    names.pop("none", None)
    constants = string_constants()
    found = []
    for p in [*MODULES.values(), PACKAGE.parent / "train.py"]:
        for node in ast.walk(ast.parse(p.read_text())):
            hits = sorted({names[s] for s in compared_literals(node, constants) if s in names}) \
                if isinstance(node, ast.Compare) else []
            if hits:
                found.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno}: "
                             f"{ast.unparse(node)} ({', '.join(hits)})")
    assert not found, "\n".join(found)


TESTS = PACKAGE.parent / "tests"


def files_testing(module: str) -> list[pathlib.Path]:
    """The test files of a module's wing folder (tests/<wing>/) that name it: by their file
    name (tests/model/test_lora.py for jaxformer.model.lora), or in their text by its dotted
    name (an import, or the docstring of a test that covers it through a table)."""
    wing, _, name = module.removeprefix("jaxformer.").partition(".")
    name = name.removesuffix(".__main__") or wing
    short = name.rsplit(".", 1)[-1]
    found = []
    for path in sorted((TESTS / wing).rglob("test_*.py")):
        text = path.read_text()
        if short.strip("_") in path.stem or re.search(
                rf"jaxformer\.{wing}\.{re.escape(name)}\b|from jaxformer\.{wing} import [^\n]*\b{short}\b"
                rf"|-m jaxformer\.{wing}\b|jaxformer\.{wing}\.{re.escape(name)}", text):
            found.append(path)
    return found


def test_each_module_has_its_tests_in_the_mirroring_folder():
    """tests/ mirrors the wings: a module's tests are found by its name in the folder of its
    wing (no test file is left flat at tests/ but the cross-cutting ones)."""
    missing = [m for m, p in MODULES.items() if p.name != "__init__.py" and
               package_of(m) in WINGS and not files_testing(m)]
    assert not missing, missing
    flat = {p.name for p in TESTS.glob("test_*.py")}
    assert flat <= {"test_layout.py", "test_readme.py", "test_docs.py", "test_bench_layout.py"}, flat
