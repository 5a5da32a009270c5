"""A wheel (non-editable install) carries everything `dflash-trt serve` needs at run time."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_model_repo_templates(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"  # pip builds in-tree: build a copy, not the checkout
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("dflash_trt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.relative_to(ROOT / "model_repo").as_posix()
                       for p in (ROOT / "model_repo").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert len(templates) >= 10
    missing = [t for t in templates if f"dflash_trt/serving/model_repo/{t}" not in names]
    assert not missing, f"templates missing from the wheel: {missing}"
    assets = ROOT / "dflash_trt" / "assets" / "drafters"  # the quickstart's bundled drafter(s)
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in assets.rglob("*") if p.is_file())
    assert not [a for a in shipped if a not in names], "bundled drafter files missing from the wheel"


def test_default_template_dir_is_the_packaged_one():
    from dflash_trt.serving.repo import default_template_dir

    d = default_template_dir()
    assert d == (ROOT / "dflash_trt" / "serving" / "model_repo").resolve()
    assert (ROOT / "model_repo").resolve() == d  # the checkout's top-level link
