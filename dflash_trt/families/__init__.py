"""Drafter families: config.json `architectures` name -> the module that implements that drafter.

Boundary: the registry only. Each family is one module of this package declaring
  NAME, ARCHITECTURE, LABEL  its names (registry key, config.json architecture, prose);
  CONFIG_KEYS, DEFAULTS      its own dflash_config fields (read dflash_config first, then top level;
                             a key in DEFAULTS is optional, the rest are required);
  TOP_LEVEL_TOO              fields also written at the top level of config.json (vLLM, SGLang read them there);
  PROJECTOR_TYPE             the SpecForge `projector_type` value that names it (None: none); a
                             DFlashDraftModel config with that projector_type is this family
                             (SGLang's layout for Domino);
  TEACHER                    the training terms that read the target's logits at the block positions
                             (a description for the log; None: none do);
  check_fields(fields, cfg)  validation (and normalisation) of those fields against the DrafterConfig;
  lengths(cfg)               the draft-length sources its propose can return ("probability",
                             "confidence"; decoding/draft_length.py);
  build(drafter)             the extra weights it adds to a DFlashDrafter (none for plain DFlash);
  load_keys / save_keys      its checkpoint tensor names <-> the drafter's state_dict names;
  propose(...)               how draft tokens, the q used for acceptance, and the per-position
                             confidence for the draft length come from the drafter;
  CAPS                       its deploy capabilities (families/capabilities.py): which engines run it
                             under which name, which of its modules stay unquantized, which engine
                             loaders read a quantized drafter, and the decoding side's switches: Triton
                             kernels, CUDA graph, draft vocabulary, per-draft cutoff, hybrid proposer
                             (config.py, modeling/fast_path.py, modeling/cuda_graph.py and
                             decoding/proposers read them there). A family without CAPS is refused by
                             every engine and by the engine's start.
Adding a family is one module plus one entry in FAMILIES. The registry sits beside config and
modeling rather than inside either because config (fields), modeling (weights) and decoding
(propose) all read it; family modules import torch and errors only, so no import cycle forms.
"""

from __future__ import annotations

from types import ModuleType

from dflash_trt.errors import CheckpointError
from dflash_trt.families import dflash, dflash2, domino, dspark

FAMILIES: dict[str, ModuleType] = {m.ARCHITECTURE: m for m in (dflash, dflash2, dspark, domino)}
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


def owner_of(key: str, value=None) -> ModuleType | None:
    """The family whose own config field `key` is (None: no family's). `projector_type` belongs to
    the family its value names."""
    if key == "projector_type":
        return next((m for m in FAMILIES.values() if m.PROJECTOR_TYPE is not None and m.PROJECTOR_TYPE == value), None)
    return next((m for m in FAMILIES.values() if key in m.CONFIG_KEYS), None)
