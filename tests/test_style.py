"""Formatting and lint: black and ruff (configured in pyproject.toml) see every Python file of the
package, the tests and the scripts, and find nothing to change.

Both tools skip folders by name unless told otherwise (black dropped any `build/` folder, which once
hid a whole package), so the first two tests check coverage against a walk of the source: a file
the tools never look at would pass the last two tests silently.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("dflash_trt", "tests", "scripts")


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed (pip install -e '.[test]')"
    )


needs_black, needs_ruff = _needs("black"), _needs("ruff")


def _python_files() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for t in TARGETS
        for p in (ROOT / t).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args, *TARGETS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _black_file_count(report: str) -> int:
    """Files black looked at, from its summary ('3 files would be reformatted, 5 files would be left
    unchanged.'; 'failed to reformat' counts too)."""
    counts = re.findall(r"(\d+) files? (?:would be reformatted|would be left unchanged|would fail to reformat)", report)
    assert counts, f"no summary in black's output:\n{report[-2000:]}"
    return sum(int(c) for c in counts)


def test_black_summary_parser():
    assert _black_file_count("Oh no!\n2 files would be reformatted, 114 files would be left unchanged.\n") == 116
    assert _black_file_count("All done!\n1 file would be left unchanged.\n") == 1


@needs_black
def test_black_sees_every_file():
    r = _run("black", "--check")
    assert r.returncode in (0, 1), r.stderr[-2000:]  # 1: something to reformat (the next tests' business)
    assert _black_file_count(r.stderr) == len(_python_files()), "black skips some files: see its exclude"


@needs_ruff
def test_ruff_sees_every_file():
    r = _run("ruff", "check", "--show-files")
    assert r.returncode == 0, r.stderr[-2000:]
    seen = {Path(line).resolve().relative_to(ROOT).as_posix() for line in r.stdout.splitlines() if line.strip()}
    assert not _python_files() - seen, f"ruff skips: {sorted(_python_files() - seen)}"


@needs_black
def test_black_finds_nothing_to_reformat():
    r = _run("black", "--check", "--quiet")
    assert r.returncode == 0, f"run `black dflash_trt tests scripts`:\n{r.stderr[-3000:]}"


@needs_ruff
def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--output-format", "concise")
    assert r.returncode == 0, f"run `ruff check --fix dflash_trt tests scripts`, then fix the rest:\n{r.stdout[-3000:]}"


def test_field_help_survives_black_wrapping(tmp_path, monkeypatch):
    """CLI --help and the YAML schema read each field's `# comment` (config.field_help); black wraps a
    field line over 120 columns into a parenthesised default with the comment inside, which must
    still be read, or reformatting would drop the help (and KeyError the CLI)."""
    from dflash_trt.config import field_help

    (tmp_path / "wrapped_cfg.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Cfg:\n"
        "    short: int = 1  # one line\n"
        '    device: str = (\n        "auto"  # where it runs: auto | cpu | cuda\n    )\n'
        "    plain: int = 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import wrapped_cfg

    assert field_help(wrapped_cfg.Cfg) == {"short": "one line", "device": "where it runs: auto | cpu | cuda"}
