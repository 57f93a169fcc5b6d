"""The README's Python examples run as written and print what their comments say."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run_and_print_what_they_claim():
    """Every ```python block, run in order in one namespace (the "Extending jaxformer"
    entries are taken out of the tables afterwards)."""
    from jaxformer.attention.backends import BACKENDS
    from jaxformer.positions.schemes import POSITION_SCHEMES
    text = README.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "Transformer(cfg)" in code and "POSITION_SCHEMES[" in code and "BACKENDS[" in code
    out = io.StringIO()
    tables = [(table, dict(table)) for table in (POSITION_SCHEMES, BACKENDS)]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {})
    finally:
        for table, before in tables:
            table.clear()
            table.update(before)
    printed = out.getvalue().splitlines()
    claimed = [line.split("#", 1)[1].strip() for line in code.splitlines()
               if line.startswith("print(")]
    assert len(printed) == len(claimed) == 7
    for got, comment in zip(printed, claimed):
        assert got and comment.startswith(got), (got, comment)  # the comment opens with it
