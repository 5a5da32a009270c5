"""proposer=hybrid: per row and round, the continuation copied from the row's own text (decoding/ngram.py)
or the drafter's block, whichever is expected to get more drafts accepted; and per round, neither when
neither has been paying: a plain decode step.

Boundary: the choice, over one round's proposal; the expectations come from the records
(decoding/records.py: the row's copy survival and calibration, the drafter's record), the costs from the
measured verify cost curve (decoding/verify_cost.py). A round goes without the drafter when every row has a
copy expected to do at least as well as the drafter has been doing (`copies_win`) or when drafting has not
been paying for itself against plain steps (PayGate, probed with back-off); the drafter's context then waits
in its queue (decoding/context_queue.py) until it runs again. In such a round each row's copy is cut to the
verify width with the most expected tokens per second (a copy not worth a wider verify becomes a plain
step), and a copy left unverified is judged against the output as it arrives (NgramRecord.judge_shadow), so
that a row whose copies start paying again is noticed. So, per round, the hybrid pays for the drafter only
where it has been paying and for copies only where they are expected to: never, in expectation, worse than
the better of its parts or plain decoding.

Lossless: every choice depends only on the past (the text, the drafter's q, earlier verdicts, measured
times), never on the target's verdict for this round. A copied draft is a point mass, q = 1 on the copied
token, so rejection sampling accepts it with probability p(token) and otherwise samples the residual, p
without that token (decoding/verify.py does exactly this for a one-hot q). Greedy rows accept a draft when
it is the target's argmax, whatever its source.
"""

from __future__ import annotations

import torch

from dflash_trt.decoding.ngram import NgramProposal
from dflash_trt.decoding.proposal import Proposal, cut_by_cost, place
from dflash_trt.decoding.proposers.base import Proposer
from dflash_trt.decoding.records import MIN_MATCH, DrafterRecord
from dflash_trt.errors import DFlashError


def refuse_unless_hybrid(name: str, caps, label: str) -> None:
    """Proposers that weigh copies against the drafter's block need its per-draft probabilities: the
    family's CAPS.hybrid says it gives them."""
    if not caps.hybrid:
        raise DFlashError(
            f"proposer={name}: {label} drafters give no per-draft probability to weigh against the copied "
            f"continuation; use proposer=dflash"
        )


def copies_win(proposals: list[NgramProposal], survivals: list[list[float]], record: DrafterRecord) -> bool:
    """Skip the drafter this round: every row has a copy expected to get at least as many drafts
    accepted as the drafter has been getting per round (drafting costs a forward pass for the batch,
    so it is skipped only when no row needs it). Never before the drafter's first round: a drafter
    nobody has tried is tried once, whatever the copies' priors promise."""
    if not record.rounds:
        return False
    return all(p.tokens and sum(surv[: len(p.tokens)]) >= record.accepted for p, surv in zip(proposals, survivals))


class HybridProposer(Proposer):
    name = "hybrid"
    copies = True
    needs = frozenset({"probability"})
    variable = True
    gated = True

    @classmethod
    def check(cls, source, caps, label) -> None:
        refuse_unless_hybrid(cls.name, caps, label)

    def propose(self, batch) -> Proposal:
        B, reqs = batch.block_size, batch.reqs
        proposals = [r.index.propose(B - 1, MIN_MATCH) for r in reqs]
        survivals = [r.ngram.survival(B - 1) for r in reqs]
        if copies_win(proposals, survivals, self.record) or self.skip_drafter(batch):
            return self._copies_only(batch, proposals, survivals)
        prop = batch.draft()
        calibrations = [r.ngram.calibration for r in reqs]
        prop.copied = choose(prop.block, prop.q, prop.n_draft, prop.probability, proposals, survivals, calibrations)
        prop.survivals = survivals
        for r, req in enumerate(reqs):  # a copy passed over for the drafter's block is judged in the shadow
            if proposals[r].tokens and not prop.copied[r] and req.ngram.shadow is None:
                req.ngram.shadow = (proposals[r].tokens, len(req.output))
        return prop

    def _copies_only(self, batch, proposals: list[NgramProposal], survivals: list[list[float]]) -> Proposal:
        """A round without the drafter: each row's copy, cut to the batch's most profitable verify width
        (none: plain steps); a copy cut away entirely is judged in the shadow of the output."""
        prop = batch.copy_round(proposals)
        prop.survivals = survivals
        cut_by_cost(prop, None, self.gate.cost, 0.0)
        kept = prop.n_draft.tolist()
        for r, req in enumerate(batch.reqs):
            if prop.copied[r] and not kept[r]:
                prop.copied[r] = False
                if req.ngram.shadow is None:
                    req.ngram.shadow = (proposals[r].tokens, len(req.output))
        return prop


def expected_accepted(probs: torch.Tensor) -> torch.Tensor:
    """probs [R, n] per-draft acceptance probabilities -> [R] expected accepted drafts."""
    return probs.float().cumprod(dim=1).sum(dim=1)


def choose(
    block: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor,
    probability: torch.Tensor,
    proposals: list[NgramProposal],
    survivals: list[list[float]],
    calibrations: list[float] | None = None,
) -> list[bool]:
    """Put the n-gram continuation into the rows where it is expected to do better; in place.

    block       [R, B]     last token + the drafter's drafts
    q           [R, B-1, V] or None (all rows greedy): a chosen row's first k rows become one-hot
    n_draft     [R]        drafts to verify; a chosen row's becomes its continuation's length k
    probability [R, B-1]   the drafter's per-draft probability (see the module docstring)
    proposals   per row, NgramProposal (tokens, at most B-1; empty: no match)
    survivals   per row, its NgramRecord.survival(B-1) for copied drafts
    calibrations per row, its NgramRecord.calibration (None: 1), scaling the drafter's expectation
    -> per row, whether the n-gram continuation was chosen."""
    R = block.shape[0]
    live = torch.arange(probability.shape[1], device=probability.device)[None] < n_draft[:, None]  # [R, B-1]
    drafter = expected_accepted(probability * live).tolist()
    calibrations = calibrations or [1.0] * R
    chosen = []
    for r in range(R):
        toks = proposals[r].tokens
        copied = sum(survivals[r][: len(toks)])
        take = len(toks) > 0 and copied > drafter[r] * calibrations[r]
        if take:
            place(block, q, n_draft, r, toks)
        chosen.append(take)
    return chosen
