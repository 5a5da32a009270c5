"""A round's proposal (what the target verifies) and the shaping the engine and proposers share: rows
whose drafts are copied from their own text (`copy_all`, `place`) and the cut to the batch's most
profitable verify width (draft_length=cost, `cut_by_cost`).

Boundary: tensors and per-row lists in, a Proposal out; the engine owns the requests and caches, the
proposers (decoding/proposers/) decide what goes into a Proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.decoding.records import MIN_MATCH
from dflash_trt.decoding.tree import Tree
from dflash_trt.decoding.verify_cost import VerifyCost, best_width


@dataclass
class Proposal:
    block: torch.Tensor  # [R, B] last token + drafts
    q: torch.Tensor | None  # [R, B-1, V] draft distributions, None when every row is greedy
    n_draft: torch.Tensor  # [R] drafts to verify per row
    predicted: torch.Tensor | None  # [R, B-1] the confidence head's acceptance predictions (None: no head)
    copied: list[bool]  # per row: drafts copied from its own text (proposer=ngram / hybrid)
    probability: torch.Tensor | None = None  # [R, B-1] the drafter's per-draft probability (hybrid's record)
    drafter_ran: bool = True  # False: copies only, or plain steps (the drafter was skipped this round)
    estimates: torch.Tensor | None = None  # [R, B-1] the drafter's acceptance estimate draft_length=cost weighs
    survivals: list[list[float]] | None = None  # per row, its copies' P(drafts 1..j+1 accepted) (None: no copies)
    tree: Tree | None = None  # a token tree to verify instead of the chain block (decoding/tree.py)
    losers: dict[int, int] | None = None  # after a tree verify: greedy rows' losing branch's accepted drafts


def copy_all(last: torch.Tensor, reqs, B: int, mask_id: int, vocab_size: int, proposals=None) -> Proposal:
    """A round without the drafter: every row verifies the continuation copied from its own text (none, or
    proposals=[]: a plain decode step). last [R] the tokens that open the blocks; reqs: the rows' requests
    (params, index); proposals: their NgramProposals when already made ([]: no row copies)."""
    R, dev = len(reqs), last.device
    block = torch.full((R, B), mask_id, dtype=torch.long, device=dev)
    block[:, 0] = last
    greedy = all(r.params.greedy for r in reqs)
    q = None if greedy else torch.zeros(R, B - 1, vocab_size, device=dev)
    n_draft = torch.zeros(R, dtype=torch.long, device=dev)
    copied = []
    for i, req in enumerate(reqs):
        if proposals is not None:
            toks = proposals[i].tokens if proposals else []
        else:
            toks = req.index.propose(B - 1, MIN_MATCH).tokens
        place(block, q, n_draft, i, toks)
        copied.append(bool(toks))
    return Proposal(block, q, n_draft, None, copied, drafter_ran=False)


def cut_by_cost(prop: Proposal, estimates: torch.Tensor | None, cost: VerifyCost, draft_seconds: float) -> Proposal:
    """draft_length=cost: cut every row to the batch's best verify width (decoding/verify_cost.py).
    A row's survival is the running product of its drafts' acceptance estimates: the drafter's
    (estimates [R, B-1], None when it offers none) or, for a copied row, its copies' record
    (prop.survivals: per row, NgramRecord.survival(B-1))."""
    R, n = prop.block.shape[0], prop.block.shape[1] - 1
    dev = prop.block.device
    survival = torch.zeros(R, n, device=dev) if estimates is None else estimates.float().cumprod(dim=1)
    for r in range(R):
        if prop.copied[r]:
            survival[r] = torch.tensor(prop.survivals[r][:n], device=dev)
    width = best_width(survival, prop.n_draft, cost, draft_seconds)
    prop.n_draft = prop.n_draft.clamp(max=width - 1)
    return prop


def place(block: torch.Tensor, q: torch.Tensor | None, n_draft: torch.Tensor, r: int, toks: list[int]) -> None:
    """Row r verifies the copied tokens `toks`: they become its drafts (block [R, B]), its q rows
    point masses on them (q [R, B-1, V] or None) and its draft count their number (n_draft [R])."""
    k = len(toks)
    ids = torch.tensor(toks, dtype=block.dtype, device=block.device)
    block[r, 1 : 1 + k] = ids
    n_draft[r] = k
    if q is not None:
        q[r, :k] = 0
        q[r, torch.arange(k, device=q.device), ids] = 1.0
