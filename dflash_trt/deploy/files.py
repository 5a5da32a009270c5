"""Folder helpers of a build: link or copy model files, copy a folder tree, write a JSON file.

Boundary: plain file operations with no knowledge of stages or backends; the stages (stages.py),
the backends (backends.py), the eval report (quant_eval.py) and the build runner (run.py) all write
through these.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link a file when src and dst share a filesystem (model weights are large and never
    modified in place), else copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_tree(src: Path, dst: Path, files_only: bool = False) -> None:
    for f in sorted(src.rglob("*") if not files_only else src.iterdir()):
        if f.is_file() and not any(p.startswith(".") for p in f.relative_to(src).parts):
            link_or_copy(f, dst / f.relative_to(src))


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
