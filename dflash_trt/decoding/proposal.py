"""A round's proposal (what the target verifies): which proposer and draft length an engine runs
(`plan`, with the one-line refusals), and the shaping applied after the drafter: rows whose drafts
are all copied from their own text (proposer=ngram) and the cut to the batch's most profitable
verify width (draft_length=cost).

Boundary: tensors and per-row lists in, a Proposal out; the engine owns the requests and caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.decoding import hybrid
from dflash_trt.decoding.draft_length import length_source
from dflash_trt.decoding.verify_cost import VerifyCost, best_width
from dflash_trt.errors import DFlashError

# none: no drafts, every round a plain decode step (the served baseline: same engine, batching and server)
PROPOSERS = ("dflash", "ngram", "hybrid", "tree", "none")
# "auto" (the generate command's default): hybrid where the drafter gives per-draft probabilities to weigh
# against copies (DFlash, DSpark, Domino), else dflash (DFlash 2). Measured on a CPU, hybrid was at least
# dflash's speed on every target x dataset pair of docs/performance.md ("Copied drafts").
AUTO = "auto"


def resolve(proposer: str, offered: tuple[str, ...]) -> str:
    """proposer, with AUTO replaced by what this drafter family supports (offered: family.lengths)."""
    if proposer != AUTO:
        return proposer
    return "hybrid" if "probability" in offered else "dflash"


@dataclass(frozen=True)
class Plan:
    length_source: str | None  # decoding/draft_length.py length_source
    cost_source: str | None  # the drafter's acceptance estimate draft_length=cost weighs drafts by
    needs: frozenset  # the confidences the family's propose must return
    variable: bool  # rows may verify fewer than B-1 drafts


def plan(draft_length: str, cutoff: float, proposer: str, label: str, offered: tuple[str, ...]) -> Plan:
    """Check the combination once, at engine start (DFlashError naming the option). label: the drafter
    family's name; offered: the confidence sources its propose can return (family.lengths)."""
    source = length_source(draft_length, cutoff)
    cost_source = next((k for k in ("confidence", "probability") if k in offered), None)
    if proposer not in PROPOSERS:
        raise DFlashError(f"proposer={proposer!r}: choose one of {', '.join(PROPOSERS)}")
    if proposer == "none" and source is not None:
        raise DFlashError(
            "proposer=none: plain decoding verifies no drafts, so draft_cutoff / draft_length do not apply; "
            "use draft_cutoff=0, draft_length=block"
        )
    if source == "cost" and cost_source is None and proposer != "ngram":
        raise DFlashError(
            f"draft_length=cost: {label} drafters give no per-draft probability to weigh against the verify "
            f"cost; use draft_length=block"
        )
    if source == "probability" and "probability" not in offered:
        raise DFlashError(
            f"draft_cutoff={cutoff}: not supported for {label} drafters (their drafts have no per-draft "
            f"probability to cut at); use draft_cutoff=0"
        )
    if source == "confidence" and "confidence" not in offered:
        raise DFlashError(
            f"draft_length=confidence: this {label} drafter has no confidence head (DSpark drafters with "
            f"enable_confidence_head have one); use draft_length=block"
        )
    if proposer == "ngram" and source not in (None, "cost"):
        raise DFlashError(
            "proposer=ngram: draft_cutoff / draft_length=confidence act on the drafter's drafts and this "
            "proposer has none; use draft_cutoff=0, draft_length=block"
        )
    if proposer == "tree" and source == "cost":
        raise DFlashError(
            "proposer=tree: draft_length=cost prices a chain verify, not a two-branch tree; use "
            "draft_length=block or proposer=hybrid"
        )
    if proposer in ("hybrid", "tree") and "probability" not in offered:
        raise DFlashError(
            f"proposer={proposer}: {label} drafters give no per-draft probability to weigh against the copied "
            f"continuation; use proposer=dflash"
        )
    needs = frozenset()
    if proposer not in ("ngram", "none"):  # the length's, the hybrid choice's, and the confidence head's for the stats
        needs = (
            frozenset({source} - {None, "cost"})
            | (frozenset({cost_source}) if source == "cost" else frozenset())
            | (frozenset({"confidence"}) if "confidence" in offered else frozenset())
            | (frozenset({"probability"}) if proposer in ("hybrid", "tree") else frozenset())
        )
    return Plan(source, cost_source, needs, source is not None or proposer != "dflash")


@dataclass
class Proposal:
    block: torch.Tensor  # [R, B] last token + drafts
    q: torch.Tensor | None  # [R, B-1, V] draft distributions, None when every row is greedy
    n_draft: torch.Tensor  # [R] drafts to verify per row
    predicted: torch.Tensor | None  # [R, B-1] the confidence head's acceptance predictions (None: no head)
    copied: list[bool]  # per row: drafts copied from its own text (proposer=ngram / hybrid)
    probability: torch.Tensor | None = None  # [R, B-1] the drafter's per-draft probability (hybrid's record)
    drafter_ran: bool = True  # False: copies only, or plain steps (the drafter was skipped this round)
    copies: list[list[int]] | None = None  # proposer=tree: per row the copy verified beside block ([]: none)


def copy_all(last: torch.Tensor, reqs, B: int, mask_id: int, vocab_size: int, proposals=None) -> Proposal:
    """proposer=ngram (and hybrid rounds without the drafter): every row verifies the continuation
    copied from its own text (none: a plain decode step). last [R] the tokens that open the blocks;
    reqs: the rows' requests (params, index); proposals: their NgramProposals when already made."""
    R, dev = len(reqs), last.device
    block = torch.full((R, B), mask_id, dtype=torch.long, device=dev)
    block[:, 0] = last
    greedy = all(r.params.greedy for r in reqs)
    q = None if greedy else torch.zeros(R, B - 1, vocab_size, device=dev)
    n_draft = torch.zeros(R, dtype=torch.long, device=dev)
    copied = []
    for i, req in enumerate(reqs):
        toks = (proposals[i] if proposals else req.index.propose(B - 1, hybrid.MIN_MATCH)).tokens
        hybrid.place(block, q, n_draft, i, toks)
        copied.append(bool(toks))
    return Proposal(block, q, n_draft, None, copied, drafter_ran=False)


def cut_by_cost(
    prop: Proposal,
    estimates: torch.Tensor | None,
    survivals: list[list[float]] | None,
    cost: VerifyCost,
    draft_seconds: float,
) -> Proposal:
    """draft_length=cost: cut every row to the batch's best verify width (decoding/verify_cost.py).
    A row's survival is the running product of its drafts' acceptance estimates: the drafter's
    (estimates [R, B-1], None when it offers none) or, for a copied row, its copies' record
    (survivals: per row, NgramRecord.survival(B-1); None when no row can copy)."""
    R, n = prop.block.shape[0], prop.block.shape[1] - 1
    dev = prop.block.device
    survival = torch.zeros(R, n, device=dev) if estimates is None else estimates.float().cumprod(dim=1)
    for r in range(R):
        if prop.copied[r]:
            survival[r] = torch.tensor(survivals[r][:n], device=dev)
    width = best_width(survival, prop.n_draft, cost, draft_seconds)
    prop.n_draft = prop.n_draft.clamp(max=width - 1)
    return prop
