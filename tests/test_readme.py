"""The README's Python examples run as written and print what their comments say."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run_and_print_what_they_claim():
    text = README.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "Transformer(cfg)" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = out.getvalue().splitlines()
    claimed = [line.split("#", 1)[1].strip() for line in code.splitlines()
               if line.startswith("print(")]
    assert len(printed) == len(claimed) == 4
    for got, comment in zip(printed, claimed):
        assert got and comment.startswith(got), (got, comment)  # the comment opens with it
