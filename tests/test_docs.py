"""The documentation: the README and the pages under docs/.

- Their Python examples run as written and print what their comments say: the ```python
  blocks of each page, in order, as one program (README.md first, then docs/ by name).
- Every module path and dotted name of jaxformer they mention exists.
- The site (mkdocs.yml) builds in strict mode, the notebooks not executed, with no warning,
  and its API pages list every module of every wing; a planted broken link, cross-reference
  to a missing name or `::: jaxformer.<missing>` fails that build."""

import contextlib
import importlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))
PACKAGE = ROOT / "jaxformer"
EXAMPLE = re.compile(r"```python\n(.*?)```", re.S)

# Lines printed (each checked against its comment) by the examples of each page.
PRINTS = {"README.md": 5, "docs/extending.md": 1, "docs/generation.md": 2,
          "docs/hybrids.md": 4, "docs/inspecting.md": 1, "docs/models.md": 3, "docs/moe.md": 1}


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def examples(path: pathlib.Path) -> str:
    """A page's ```python blocks, in order, as one program; every other line of the page
    left blank, so that a traceback's line numbers are the page's."""
    text = path.read_text()
    code = [""] * text.count("\n")
    for block in EXAMPLE.finditer(text):
        first = text.count("\n", 0, block.start(1))
        for i, line in enumerate(block.group(1).splitlines()):
            code[first + i] = line
    return "\n".join(code) if any(code) else ""


def claims(code: str) -> list[str]:
    """What each `print(...)  # comment` line says it prints: its comment."""
    return [line.split("#", 1)[1].strip() for line in code.splitlines()
            if line.startswith("print(")]


def test_the_pages_with_examples_and_what_they_print():
    """Every page with examples is counted here (a new one is added on purpose), and the
    examples still show a model built, a scheme and a backend added from outside."""
    found = {rel(p): len(claims(examples(p))) for p in PAGES if examples(p)}
    assert found == PRINTS
    code = "\n".join(examples(p) for p in PAGES)
    assert "Transformer(cfg)" in code and "POSITION_SCHEMES[" in code and "BACKENDS[" in code


@pytest.mark.parametrize("page", [p for p in PAGES if examples(p)], ids=rel)
def test_examples_run_and_print_what_they_claim(page):
    """A page's blocks run in order in one namespace; each printed line opens its print's
    comment. (Entries that "Extending jaxformer" adds to the tables are taken out after.)"""
    from jaxformer.attention.backends import BACKENDS
    from jaxformer.positions.schemes import POSITION_SCHEMES
    code = examples(page)
    tables = [(table, dict(table)) for table in (POSITION_SCHEMES, BACKENDS)]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(page), "exec"), {"__name__": f"docs_{page.stem}"})
    finally:
        for table, before in tables:
            table.clear()
            table.update(before)
    printed = out.getvalue().splitlines()
    claimed = claims(code)
    assert len(printed) == len(claimed) == PRINTS[rel(page)]
    for got, comment in zip(printed, claimed):
        assert got and comment.startswith(got), (got, comment)  # the comment opens with it


# Mentioned on purpose but not files of the repository: a placeholder, an output folder.
NOT_FILES = {"configs/NAME.yaml", "bench/results"}
DOTTED = re.compile(r"\bjaxformer(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.])(?:jaxformer|tests|bench|configs|notebooks|docs)/[\w/.-]*\w")


def resolves(name: str) -> bool:
    """A dotted name is a module, or an attribute of its longest importable prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)|`(test_\w+)`")


def cited_test_exists(path: str | None, name: str) -> bool:
    files = [ROOT / path] if path else (ROOT / "tests").rglob("test_*.py")
    return any(f.exists() and f"def {name}(" in f.read_text() for f in files)


def stale_names(text: str) -> list[str]:
    """The module paths, dotted names and tests (`tests/x.py::test_y`, `test_y`) in a text
    that no longer exist."""
    paths = {p for p in PATH.findall(text) if p not in NOT_FILES}
    tests = {(path or None, name or bare) for path, name, bare in TEST_REF.findall(text)}
    return (sorted(p for p in paths if not (ROOT / p).exists())
            + sorted(n for n in set(DOTTED.findall(text)) if not resolves(n))
            + sorted(f"{p}::{n}" if p else n for p, n in tests if not cited_test_exists(p, n)))


def test_every_module_path_and_name_the_docs_mention_exists():
    stale = {rel(p): stale_names(p.read_text()) for p in PAGES}
    assert not {page: names for page, names in stale.items() if names}


def test_a_stale_path_or_name_is_found():
    """A renamed module's old path, a missing attribute and tests that do not exist (one
    by its file, one by its name alone) are each named."""
    text = ("`jaxformer/backends.py` and `jaxformer.attention.backends.BACKENDZ`, beside "
            "`jaxformer/attention/backends.py` and `jaxformer.attention.backends.BACKENDS`; "
            "`tests/test_layout.py::test_no_import_circles` beside `test_no_import_circle`, "
            "and `test_no_such_test`")
    assert stale_names(text) == ["jaxformer/backends.py", "jaxformer.attention.backends.BACKENDZ",
                                 "test_no_such_test",
                                 "tests/test_layout.py::test_no_import_circles"]


def mkdocs_build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict`, the notebooks rendered as stored (not executed), run in the
    site's folder (nothing is written into the repository)."""
    env = {**os.environ, "JAXFORMER_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], cwd=site.parent, env=env, capture_output=True,
                          text=True, timeout=900)


def warnings(build: subprocess.CompletedProcess) -> list[str]:
    return [line for line in build.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]


def package_modules(wing: pathlib.Path) -> list[str]:
    """jaxformer.<wing>.<module> for every module of a wing (subpackages' too), read from
    the folder: the API pages must list each."""
    names = []
    for path in wing.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] != "__main__":
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def test_the_site_builds_strictly_with_every_module_and_notebook(tmp_path):
    build = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert build.returncode == 0 and not warnings(build), "\n".join(
        warnings(build) or build.stderr.splitlines()[-30:])
    wings = [p for p in sorted(PACKAGE.iterdir()) if (p / "__init__.py").exists()]
    assert len(wings) >= 12
    for wing in wings:
        page = (tmp_path / "site" / "api" / f"{wing.name}.html").read_text()
        missing = [m for m in package_modules(wing) if f'id="{m}"' not in page]
        assert not missing, f"api/{wing.name}.md lacks {missing}"
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        page = tmp_path / "site" / "notebooks" / f"{notebook.stem}.html"
        assert "jupyter-wrapper" in page.read_text(), notebook.name


def planted_copy(tmp_path: pathlib.Path, plant: str) -> pathlib.Path:
    """mkdocs.yml and docs/ copied to tmp_path, with `plant` appended to docs/training.md;
    the code, the hook and the README read from the repository."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "training.md", "a") as page:
        page.write(f"\n\n{plant}\n")
    config = (ROOT / "mkdocs.yml").read_text()
    for old, new in [("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}"),
                     ("- docs/hooks.py", f"- {ROOT / 'docs' / 'hooks.py'}"),
                     ("paths: [.]", f"paths: [{ROOT}]"),
                     ("base_path: !relative $config_dir", f"base_path: {ROOT}")]:
        assert old in config, old
        config = config.replace(old, new)
    (tmp_path / "mkdocs.yml").write_text(config)
    return tmp_path / "mkdocs.yml"


def test_a_broken_link_or_a_missing_name_fails_the_strict_build(tmp_path):
    """Two plants in one page, each named in its own warning: a link to a page that does
    not exist, and a cross-reference to an API name that does not."""
    config = planted_copy(tmp_path, "See [the old page](no_such_page.md) and "
                                    "[generate][jaxformer.decode.loops.no_such_function].")
    build = mkdocs_build(config, tmp_path / "site")
    assert build.returncode != 0
    assert any("no_such_page.md" in w for w in warnings(build)), build.stderr[-3000:]
    assert any("jaxformer.decode.loops.no_such_function" in w for w in warnings(build)), \
        build.stderr[-3000:]


def test_a_stale_api_name_fails_the_build(tmp_path):
    build = mkdocs_build(planted_copy(tmp_path, "::: jaxformer.no_such_module"), tmp_path / "site")
    assert build.returncode != 0
    assert "jaxformer.no_such_module" in build.stderr, build.stderr[-3000:]
