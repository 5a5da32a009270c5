"""The README's Python example runs as written (on the real SmolLM2 and its bundled drafter)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_example() -> str:
    section = README.read_text().split("## Python in 30 lines", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: the 'Python in 30 lines' section lost its code block"
    return m.group(1)


def test_python_example_is_short_and_compiles():
    code = _python_example()
    assert len(code.splitlines()) <= 30
    compile(code, "README.md", "exec")


@pytest.mark.slow
def test_python_example_runs(capsys):
    exec(compile(_python_example(), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "tau=" in out and "histogram" in out
