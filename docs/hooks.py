"""MkDocs hook (mkdocs.yml `hooks:`): the pages that are read from the code at build time.

- The API reference: one page per wing of jaxformer/ (the wings in tests/test_layout.py's
  WINGS order, then any other package folder), listing every module of the wing, each
  rendered by mkdocstrings from its docstrings. A new module or wing shows up without
  editing the docs; a renamed one drops out (and a link to its old name fails the strict
  build).
- The notebooks of notebooks/, added as pages for mkdocs-jupyter to render (executed when
  JAXFORMER_DOCS_EXECUTE=true: `make docs`).

Nothing here imports jaxformer: the package is read with `ast`, as mkdocstrings reads it."""

from __future__ import annotations

import ast
import logging
import pathlib
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxformer"
NOTEBOOKS = ROOT / "notebooks"
API_SECTION, NOTEBOOK_SECTION = "API reference", "Notebooks"


def wing_order() -> list[str]:
    """The wings bottom up: tests/test_layout.py's WINGS, then folders it does not list."""
    listed = []
    layout = ROOT / "tests" / "test_layout.py"
    if layout.exists():
        for node in ast.parse(layout.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "WINGS"
                                                    for t in node.targets):
                listed = list(ast.literal_eval(node.value))
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    return [w for w in listed if w in folders] + [w for w in folders if w not in listed]


def modules(wing: str) -> list[str]:
    """The modules of a wing, dotted from the wing (`loop`; a subpackage as `objectives`,
    then `objectives.entry`, ...); the wing's __init__ and a CLI's __main__ left out."""
    names = []
    for p in (PACKAGE / wing).rglob("*.py"):
        parts = p.relative_to(PACKAGE / wing).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[-1] != "__main__" and "__pycache__" not in parts:
            names.append(".".join(parts))
    return sorted(names)


def module_path(wing: str, module: str) -> pathlib.Path:
    path = PACKAGE / wing / pathlib.Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def first_sentence(path: pathlib.Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    first = re.split(r"(?<!e\.g)(?<!i\.e)(?<! al)(?<! vs)\.\s+(?=[A-Z])", text, maxsplit=1)[0]
    return first.rstrip(".") + "." if first else ""


def wing_page(wing: str) -> str:
    """A wing's page: its package docstring, then each module's API."""
    lines = [f"# jaxformer.{wing}", "",
             f"::: jaxformer.{wing}", "    options:", "      show_root_heading: false",
             "      members: false", "",
             "| module | what it holds |", "|---|---|"]
    lines += [f"| [`{m}`](#jaxformer.{wing}.{m}) | "
              f"{first_sentence(module_path(wing, m)).replace('|', '/')} |"
              for m in modules(wing)]
    lines.append("")
    for m in modules(wing):
        lines += [f"::: jaxformer.{wing}.{m}", ""]
    return "\n".join(lines)


def public_names() -> list[tuple[str, str]]:
    """(name, module it comes from) for each name `jaxformer/__init__.py` exports (its
    __all__)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    exported = next((ast.literal_eval(node.value) for node in tree.body
                     if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", "") == "__all__" for t in node.targets)), None)
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.count(".") >= 2:
            names += [(a.asname or a.name, node.module) for a in node.names
                      if exported is None or (a.asname or a.name) in exported]
    return sorted(names)


def defining_module(name: str, module: str) -> str:
    """The module that defines `name`, following `from x import name` re-exports."""
    path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return module
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "jaxformer.") and any((a.asname or a.name) == name for a in node.names):
            return defining_module(name, node.module)
    return module


def index_page(wings: list[str]) -> str:
    """The API reference's first page: the package docstring, the public names, the wings."""
    lines = ["# API reference", "",
             "Generated from the docstrings at every build: one page per wing of `jaxformer/`, "
             "bottom up (a wing imports only the wings above it in this list).", "",
             "::: jaxformer", "    options:", "      show_root_heading: false",
             "      members: false", "",
             "## `import jaxformer`", "", "| name | defined in |", "|---|---|"]
    for name, module in public_names():
        home = defining_module(name, module)
        lines.append(f"| [`jaxformer.{name}`][{home}.{name}] | `{home}` |")
    lines += ["", "## The wings", "", "| wing | what it holds |", "|---|---|"]
    for wing in wings:
        doc = first_sentence(PACKAGE / wing / "__init__.py").replace("|", "/")
        lines.append(f"| [`jaxformer.{wing}`]({wing}.md) | {doc} |")
    return "\n".join(lines) + "\n"


def notebooks() -> list[str]:
    return sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def fill_section(nav: list, title: str, entries: list) -> None:
    """Append entries to the nav section named `title` (made at the end when missing)."""
    for item in nav:
        if isinstance(item, dict) and title in item:
            item[title] = list(item[title] or []) + entries
            return
    nav.append({title: entries})


class DocstringBrackets(logging.Filter):
    """Docstrings here are prose, never cross-references: `accuracy[seed][length]` or
    `[--out DIR] [--seeds N]` read to Markdown as reference links, and autorefs warns that
    their targets do not exist. Those warnings (from a file of jaxformer/) become info;
    an unresolved reference written in a page of docs/ still fails the strict build."""

    def filter(self, record):
        if record.levelno == logging.WARNING and f"from {PACKAGE}" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_config(config):
    for name in list(logging.root.manager.loggerDict):  # autorefs' loggers, loaded by now
        logger = logging.getLogger(name)
        if name.startswith("mkdocs.plugins.mkdocs_autorefs") and not any(
                isinstance(f, DocstringBrackets) for f in logger.filters):
            logger.addFilter(DocstringBrackets())
    nav = config.nav if config.nav is not None else []
    wings = wing_order()
    fill_section(nav, API_SECTION, [{f"jaxformer.{w}": f"api/{w}.md"} for w in wings])
    fill_section(nav, NOTEBOOK_SECTION, [f"notebooks/{n}" for n in notebooks()])
    config.nav = nav
    return config


@event_priority(50)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
    wings = wing_order()
    files.append(File.generated(config, "api/index.md", content=index_page(wings)))
    for wing in wings:
        files.append(File.generated(config, f"api/{wing}.md", content=wing_page(wing)))
    for name in notebooks():
        files.append(File(f"notebooks/{name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files
