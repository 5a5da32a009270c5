"""Drafters that ship inside the package, trained here by `dflash-trt train` with a recorded recipe.

Boundary: this module only *finds* drafter checkpoints by name. No model hub is reachable at run
time, so the quickstart's drafter travels with the code: `dflash_trt/assets/drafters/<name>/`
holds a normal z-lab-layout checkpoint (config.json + model.safetensors, bf16) and `recipe.json`
(target, the exact data/train commands that produced it, the measured tau). Anything that accepts
`--drafter DIR` also accepts one of these names. Reproduce one with the commands in its recipe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import CheckpointError

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafters"
RECIPE = "recipe.json"


@dataclass(frozen=True)
class BundledDrafter:
    name: str
    path: Path
    target: str  # model name the drafter was trained against (dflash_trt.hub.models)
    block_size: int
    recipe: dict


def bundled_drafters(root: Path = ASSETS) -> dict[str, BundledDrafter]:
    """Every complete bundled drafter under root, by name."""
    out: dict[str, BundledDrafter] = {}
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        files = [d / "config.json", d / "model.safetensors", d / RECIPE]
        if not all(f.is_file() for f in files):
            continue
        try:
            recipe = json.loads((d / RECIPE).read_text())
            cfg = json.loads((d / "config.json").read_text())
            out[d.name] = BundledDrafter(d.name, d, str(recipe["target"]), int(cfg["block_size"]), recipe)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"bundled drafter {d}: broken {RECIPE} or config.json ({e})") from None
    return out


def bundled_drafter_for(target: str, block_size: int | None = None, root: Path = ASSETS) -> BundledDrafter | None:
    """The bundled drafter trained for the named target (and block size, if given), if any."""
    for b in bundled_drafters(root).values():
        if b.target == Path(str(target)).name and (block_size is None or b.block_size == block_size):
            return b
    return None


def resolve_drafter(name_or_dir: str, root: Path = ASSETS) -> str:
    """A checkpoint folder as is, or the folder of the bundled drafter with that name."""
    if Path(name_or_dir).expanduser().is_dir():
        return str(Path(name_or_dir).expanduser())
    found = bundled_drafters(root)
    if name_or_dir in found:
        return str(found[name_or_dir].path)
    known = ", ".join(found) or "none in this install"
    raise CheckpointError(
        f"drafter {name_or_dir!r}: not a folder and not a bundled drafter name (bundled: {known}); "
        f"pass a DFlash checkpoint folder (config.json + model.safetensors) or train one with "
        f"`dflash-trt train`"
    )
