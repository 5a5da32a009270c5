"""Every documentation pointer resolves: links in README.md and docs/*.md, and `docs/<file>.md#anchor` /
`README.md#anchor` in the package's code strings (error messages, docstrings), name a file that exists and,
with an anchor, a heading of it (GitHub's slug: lower case, punctuation dropped, spaces to hyphens,
repeats numbered -1, -2, ...). Old-style pointers in code (`README, "Section"`) must name a README heading
too, so that a section moved to docs/ cannot leave an error message pointing at nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
CODE_LINK = re.compile(r"((?:docs/[\w.-]+|README)\.md)(#[\w-]+)?")
README_SECTION = re.compile(r"README[ ,]+[\"'\u201c]([^\"'\u201d]+)[\"'\u201d]")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"#{1,6} (.+)", line)
        if fenced or not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def check(target: str, base: Path) -> str | None:
    """None when target (path[#anchor], relative to base's folder) resolves, else why not."""
    if re.match(r"[a-z]+://|mailto:", target):
        return None
    path, _, anchor = target.partition("#")
    file = (base.parent / path).resolve() if path else base
    if not file.exists():
        return f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}"
    return None


def test_slug_matches_github():
    assert slug("Copied drafts: n-gram and hybrid proposers") == "copied-drafts-n-gram-and-hybrid-proposers"
    assert slug("GPU kernel check: NVIDIA H200, 2026-12-04") == "gpu-kernel-check-nvidia-h200-2026-12-04"
    assert slug("Serve (walkthrough, CPU)") == "serve-walkthrough-cpu"
    assert slug("`dflash-trt bench` on 2 cores") == "dflash-trt-bench-on-2-cores"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_markdown_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
    bad = [why for t in MD_LINK.findall(text) if (why := check(t, doc))]
    assert not bad, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def _code_strings():
    for path in sorted((ROOT / "dflash_trt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield path, node.lineno, node.value


def test_doc_pointers_in_code_resolve():
    readme = anchors(ROOT / "README.md")
    bad = []
    for path, line, text in _code_strings():
        where = f"{path.relative_to(ROOT)}:{line}"
        for file, anchor in CODE_LINK.findall(text):
            if why := check(file + anchor, ROOT / "README.md"):
                bad.append(f"{where}: {why}")
        for section in README_SECTION.findall(text):
            if slug(section) not in readme:
                bad.append(f"{where}: README has no section {section!r} (moved to docs/? point at docs/...md#anchor)")
    assert not bad, "doc pointers that lead nowhere:\n" + "\n".join(bad)


def test_package_docstring_lists_every_module_once():
    """dflash_trt/__init__.py's layout names each top-level module and subpackage exactly once."""
    import dflash_trt

    doc = dflash_trt.__doc__
    pkg = ROOT / "dflash_trt"
    names = [p.name for p in pkg.glob("*.py") if p.name != "__init__.py"]
    names += [p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").is_file()]
    counts = {n: len(re.findall(rf"^  {re.escape(n)}\s", doc, flags=re.M)) for n in names}
    assert all(c == 1 for c in counts.values()), {n: c for n, c in counts.items() if c != 1}
