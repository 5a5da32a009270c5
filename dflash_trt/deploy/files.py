"""Folder helpers of a build: link or copy model files, copy a folder tree, write a JSON file, read
a folder's safetensors.

Boundary: plain file operations with no knowledge of stages or backends; the stages (stages.py),
the engine configs (trtllm.py, emit.py, emit_layout.py), the eval report (quant_eval.py) and the
build runner (run.py) all write through these.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_trt.errors import CheckpointError


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


def read_state(folder: Path, what: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's *.safetensors shards; CheckpointError when there are none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{what}{folder}: no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
