"""README.md is a short user's document whose Python example runs as written (on the real SmolLM2 and its
bundled drafter); its links and those of docs/*.md resolve; its serve walkthrough is the one docs/deploy.md
records a run of."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _python_example() -> str:
    section = README.read_text().split("## Python in 30 lines", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: the 'Python in 30 lines' section lost its code block"
    return m.group(1)


def _serve_walkthrough(text: str) -> str:
    section = text.split("## Serve (walkthrough, CPU)", 1)[1]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "the serve walkthrough lost its code block"
    return m.group(1)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (headings inside code fences left out)."""
    anchors, fence = set(), ""
    for line in path.read_text().splitlines():
        m = re.match(r"`{3,}", line)
        if m and not fence:
            fence = m.group(0)
        elif m and line.strip() == fence:
            fence = ""
        elif not fence and line.startswith("#"):
            anchors.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return anchors


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_python_example_is_short_and_compiles():
    code = _python_example()
    assert len(code.splitlines()) <= 30
    compile(code, "README.md", "exec")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path) if path else doc
        assert target.exists(), f"{doc.name}: {link} does not exist"
        if anchor:
            assert anchor in _anchors(target), f"{doc.name}: {link}: no such heading"


def test_docs_lead_with_conclusions():
    assert {p.name for p in DOCS} >= {"performance.md", "training.md", "deploy.md", "experiments.md"}
    for doc in DOCS:
        headings = re.findall(r"^## (.+)$", doc.read_text(), re.M)
        assert headings and headings[0] == "Current conclusions", doc.name


def test_serve_walkthrough_is_the_recorded_one():
    assert _serve_walkthrough(README.read_text()) == _serve_walkthrough((ROOT / "docs" / "deploy.md").read_text())


@pytest.mark.slow
def test_python_example_runs(capsys):
    exec(compile(_python_example(), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "tau=" in out and "histogram" in out
