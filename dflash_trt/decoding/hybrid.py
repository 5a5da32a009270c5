"""Copied drafts: the n-gram proposer (every row's drafts copied from its own text, `place`) and the
hybrid proposer's `choose` rule: per row and round, verify the continuation copied from the row's own
text (decoding/ngram.py) instead of the drafter's block when it is expected to get more drafts
accepted.

Boundary: the choice, tensor in / tensor out over one round's proposal; the per-request n-gram index
and acceptance record live with the request in the engine.

Expected accepted drafts of a proposal whose draft j is accepted (given the earlier ones) with
probability a_j is sum_j prod_{i<=j} a_i. For the drafter's block, a_j is its own probability of
draft j (the "probability" confidence: for greedy rows the drafted token's, for sampled rows q's
top); for the n-gram continuation, a_j = r, the row's running n-gram acceptance rate (Laplace:
(accepted + 1) / (drafted + 2)), which learns how well this request's text repeats itself.

Lossless: the choice depends only on the past (the text, the drafter's q, earlier verdicts), never
on the target's verdict for this round. A copied draft is a point mass, q = 1 on the copied token,
so rejection sampling accepts it with probability p(token) and otherwise samples the residual, p
without that token (decoding/verify.py does exactly this for a one-hot q). Greedy rows accept a
draft when it is the target's argmax, whatever its source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.decoding.ngram import NgramProposal

# a copy needs a matched suffix of at least this many tokens: a single repeated token predicts its
# successor poorly (prompt lookup, HF's and vLLM's n-gram drafting, likewise match 2+ by default)
MIN_MATCH = 2


@dataclass
class NgramRecord:
    """One request's n-gram source: how many copied drafts were judged and accepted."""

    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.drafted + 2)


def expected_accepted(probs: torch.Tensor) -> torch.Tensor:
    """probs [R, n] per-draft acceptance probabilities -> [R] expected accepted drafts."""
    return probs.float().cumprod(dim=1).sum(dim=1)


def choose(
    block: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor,
    probability: torch.Tensor,
    proposals: list[NgramProposal],
    rates: list[float],
) -> list[bool]:
    """Put the n-gram continuation into the rows where it is expected to do better; in place.

    block       [R, B]     last token + the drafter's drafts
    q           [R, B-1, V] or None (all rows greedy): a chosen row's first k rows become one-hot
    n_draft     [R]        drafts to verify; a chosen row's becomes its continuation's length k
    probability [R, B-1]   the drafter's per-draft probability (see the module docstring)
    proposals   per row, NgramProposal (tokens, at most B-1; empty: no match)
    rates       per row, its NgramRecord.rate
    -> per row, whether the n-gram continuation was chosen."""
    R = block.shape[0]
    live = torch.arange(probability.shape[1], device=probability.device)[None] < n_draft[:, None]  # [R, B-1]
    drafter = expected_accepted(probability * live).tolist()
    chosen = []
    for r in range(R):
        toks = proposals[r].tokens
        copied = sum(rates[r] ** j for j in range(1, len(toks) + 1))
        take = len(toks) > 0 and copied > drafter[r]
        if take:
            place(block, q, n_draft, r, toks)
        chosen.append(take)
    return chosen


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
