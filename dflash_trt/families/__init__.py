"""Drafter families: config.json `architectures` name -> the module that implements that drafter.

Boundary: the registry only. Each family is one module of this package declaring
  NAME, ARCHITECTURE, LABEL  its names (registry key, config.json architecture, prose);
  CONFIG_KEYS                its own dflash_config fields (read dflash_config first, then top level);
  KERNELS                    whether the Triton kernels / CUDA graph / TensorRT paths implement it;
  check_fields(fields, cfg)  validation of those fields against the rest of the DrafterConfig;
  build(drafter)             the extra weights it adds to a DFlashDrafter (none for plain DFlash);
  load_keys / save_keys      its checkpoint tensor names <-> the drafter's state_dict names;
  propose(...)               how draft tokens and the q used for acceptance come from the drafter.
Adding a family is one module plus one entry in FAMILIES. The registry sits beside config and
modeling rather than inside either because config (fields), modeling (weights) and decoding
(propose) all read it; family modules import torch and errors only, so no import cycle forms.
"""

from __future__ import annotations

from types import ModuleType

from dflash_trt.errors import CheckpointError
from dflash_trt.families import dflash, dflash2

FAMILIES: dict[str, ModuleType] = {m.ARCHITECTURE: m for m in (dflash, dflash2)}
DEFAULT = dflash  # a config.json without `architectures`


def for_architectures(archs: list[str] | None) -> ModuleType:
    """The family module of an `architectures` list (None: plain DFlash); CheckpointError otherwise."""
    if archs is None:
        return DEFAULT
    known = [FAMILIES[a] for a in archs if a in FAMILIES]
    unknown = [a for a in archs if a not in FAMILIES]
    if unknown or len(known) != 1:
        raise CheckpointError(
            f"drafter config.json architectures {unknown or archs}: not a drafter dflash-trt implements "
            f"(supported, one of: {', '.join(FAMILIES)})"
        )
    return known[0]


def owner_of(key: str) -> ModuleType | None:
    """The family whose own config field `key` is (None: no family's)."""
    return next((m for m in FAMILIES.values() if key in m.CONFIG_KEYS), None)
