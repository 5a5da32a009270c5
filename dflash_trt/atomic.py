"""atomic_dir: write a folder so that readers see either the old folder or the complete new one.

Boundary: the one home of "build in a temp dir next to the destination, rename into place". Every
folder this package writes as a unit goes through it: drafter checkpoints (modeling/drafter.py),
training checkpoints (train/trainer.py), Triton model repositories (serving/repo.py), fetched models
(hub/models.py), build outputs (deploy/run.py, deploy/hf_checkpoint.py) and AOT
kernel folders (kernels/aot.py). What goes inside (and any completion marker, e.g. hub's
`.complete`) stays with the caller.

The temp dir and the moved-aside old folder are hidden siblings of the destination
(`.NAME.<tag>-*`, `.NAME.old-<pid>-*`), on the same filesystem so that the renames are atomic,
and named with the pid so that a killed writer's leftovers can be told apart (deploy/run.py
cleans them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(folder: str | Path, tag: str = "tmp") -> Iterator[Path]:
    """with atomic_dir(out) as tmp: write files into tmp (an empty folder). When the block ends
    without error, tmp becomes `out`: an existing `out` is moved aside first and removed last, so
    it is replaced only on success. On any error (Ctrl-C included) tmp is removed and `out` is
    left as it was. tag names the temp dir: `.NAME.<tag>-*` next to `out`."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.{tag}-", dir=folder.parent))
    try:
        yield tmp
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}-{time.time_ns()}"
            os.replace(folder, old)
        try:
            os.replace(tmp, folder)
        except BaseException:  # a failed swap must not lose the old folder
            if old is not None:  # put it back, unless another writer's folder took the place
                os.replace(old, folder) if not folder.exists() else shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
