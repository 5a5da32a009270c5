"""Proposers: where a round's drafts come from, one module per proposer behind one interface (base.py
Proposer: propose for the batch, observe the verdicts), chosen once by name from REGISTRY.

dflash   the drafter's block every round (the paper's loop)
ngram    the continuation copied from the row's own text; the drafter never runs
hybrid   per row and round the copy or the drafter's block, or a plain step where neither pays
tree     the copy and the drafter's block verified together in one tree-masked target pass
none     no drafts: plain decode steps through the same engine (a served baseline)

Boundary: naming, resolving ("auto") and checking a proposer against a drafter family and draft length
(`plan`, one-line refusals at engine start); the engine (decoding/engine.py) never compares names. Adding a
proposer: its module here plus one line in REGISTRY.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from dflash_trt.decoding.draft_length import length_source
from dflash_trt.decoding.proposers.base import Proposer
from dflash_trt.errors import DFlashError
from dflash_trt.families.capabilities import Capabilities, caps_of

# name -> the module defining its Proposer subclass (imported when chosen)
REGISTRY = {
    "dflash": "dflash_trt.decoding.proposers.dflash",
    "ngram": "dflash_trt.decoding.proposers.ngram",
    "hybrid": "dflash_trt.decoding.proposers.hybrid",
    "tree": "dflash_trt.decoding.proposers.tree",
    "none": "dflash_trt.decoding.proposers.none",
}
PROPOSERS = tuple(REGISTRY)
# "auto": hybrid where the drafter family's CAPS allows it (its per-draft probabilities weigh the drafter
# against copies: DFlash, DSpark, Domino), else dflash (DFlash 2)
AUTO = "auto"
CHOICES = (*PROPOSERS, AUTO)  # what every entry point accepts for `proposer`


def proposer_class(name: str) -> type[Proposer]:
    """The Proposer subclass registered under name (DFlashError naming the choices otherwise)."""
    if name not in REGISTRY:
        raise DFlashError(f"proposer={name!r}: choose one of {', '.join(PROPOSERS)} (or {AUTO})")
    module = importlib.import_module(REGISTRY[name])
    return next(v for v in vars(module).values() if isinstance(v, type) and getattr(v, "name", None) == name)


def resolve(proposer: str, caps: Capabilities) -> str:
    """proposer, with AUTO replaced by what this drafter family supports (caps: its CAPS)."""
    if proposer != AUTO:
        return proposer
    return "hybrid" if caps.hybrid else "dflash"


@dataclass(frozen=True)
class Plan:
    proposer: type[Proposer]
    length_source: str | None  # decoding/draft_length.py length_source
    cost_source: str | None  # the drafter's acceptance estimate draft_length=cost weighs drafts by
    needs: frozenset  # the confidences the family's propose must return
    variable: bool  # rows may verify fewer than B-1 drafts


def plan(draft_length: str, cutoff: float, proposer: str, family, offered: tuple[str, ...]) -> Plan:
    """Check the combination once, at engine start (DFlashError naming the option). proposer: a registered
    name or AUTO; family: the drafter family module (its CAPS says what decoding may do with it; a family
    without CAPS is refused); offered: the confidence sources this drafter's propose can return
    (family.lengths: a confidence head is per drafter)."""
    caps, label = caps_of(family), family.LABEL
    source = length_source(draft_length, cutoff)
    cls = proposer_class(resolve(proposer, caps))
    cost_source = next((k for k in ("confidence", "probability") if k in offered), None)
    if source == "cost" and cost_source is None and cls.uses_drafter:
        raise DFlashError(
            f"draft_length=cost: {label} drafters give no per-draft probability to weigh against the verify "
            f"cost; use draft_length=block"
        )
    if source == "probability" and not caps.draft_cutoff:
        raise DFlashError(
            f"draft_cutoff={cutoff}: not supported for {label} drafters (their drafts have no per-draft "
            f"probability to cut at); use draft_cutoff=0"
        )
    if source == "confidence" and "confidence" not in offered:
        raise DFlashError(
            f"draft_length=confidence: this {label} drafter has no confidence head (DSpark drafters with "
            f"enable_confidence_head have one); use draft_length=block"
        )
    cls.check(source, caps, label)
    needs = frozenset()
    if cls.uses_drafter:  # the length's, the proposer's choice's, and the confidence head's for the stats
        needs = (
            frozenset({source} - {None, "cost"})
            | (frozenset({cost_source}) if source == "cost" else frozenset())
            | (frozenset({"confidence"}) if "confidence" in offered else frozenset())
            | cls.needs
        )
    return Plan(cls, source, cost_source, needs, source is not None or cls.variable)
