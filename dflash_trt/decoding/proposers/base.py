"""The Proposer interface: what a round verifies (`propose`) and what it learns from the verdicts (`observe`).

Boundary: a proposer decides a round's Proposal (decoding/proposal.py) for the engine's batch and keeps what
it learns (decoding/records.py, owned by the engine's Session); the engine (decoding/engine.py) keeps the
requests, the caches, the drafter's context queue, verify / accept / rewind and the statistics. A proposer
reads the batch through the engine's small surface below and never writes engine state:

  batch.reqs            the running requests, in row order (params, generator, output, index, ngram)
  batch.last            [R] the tokens that open the next block
  batch.block_size      B: a proposal holds the last token and at most B-1 drafts
  batch.draft()         run the drafter (its queued context injected first) -> Proposal of its block
  batch.copy_round(p)   a round without the drafter: rows verify their copies p ([]: plain steps); the
                        drafter's context waits in its queue (decoding/context_queue.py)
  batch.draft_seconds   running mean of the propose step's time

A new proposer is one module here with a Proposer subclass, plus one line in the registry
(decoding/proposers/__init__.py).
"""

from __future__ import annotations

from dflash_trt.decoding.ngram import SuffixIndex
from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.records import DrafterRecord
from dflash_trt.decoding.verify import Verdict
from dflash_trt.decoding.verify_cost import PayGate, VerifyCost


class Proposer:
    name = ""
    uses_drafter = True  # False: the drafter never runs, so its context is never injected (ngram)
    copies = False  # its rows keep an index of their own text and a copy record (ngram, hybrid, tree)
    cache_blocks = 1  # verify width in blocks the target cache leaves room for (a tree: 2B-1 wide)
    needs = frozenset()  # the drafter confidences its choice reads ("probability": hybrid, tree)
    variable = False  # rows may verify fewer than B-1 drafts even at draft_length=block
    gated = False  # the drafter is skipped while it has not been paying, whatever the draft length (hybrid)

    def __init__(self, record: DrafterRecord, cost: VerifyCost | None):
        """record: the drafter's record for this proposer (the Session's); cost: the verify cost curve when
        the engine measured one (draft_length=cost, or a gated proposer), else None."""
        self.record = record
        self.gate = PayGate(cost) if cost is not None else None

    @classmethod
    def check(cls, source: str | None, caps, label: str) -> None:
        """Refuse, in one line (DFlashError naming the option), a draft length or drafter family this
        proposer cannot run. source: decoding/draft_length.py length_source; caps / label: the drafter
        family's CAPS (families/capabilities.py) and name."""

    def start(self, req, ids: list[int]) -> None:
        """A request joins with prompt ids: the copying proposers give it an index of its text and a copy
        record started from the drafter's history (DrafterRecord.start)."""
        if self.copies:
            req.index, req.ngram = SuffixIndex(ids), self.record.start()

    def propose(self, batch) -> Proposal:
        raise NotImplementedError

    def observe(self, batch, prop: Proposal, verdict: Verdict, seconds: float) -> None:
        """After the round's tokens were emitted: learn from each row's verdict. seconds: the propose
        step's time. Copied rows feed their copy record; drafter rounds the drafter's record (and, where the
        drafter's probabilities were read, the row's calibration)."""
        accepted, drafted = verdict.accepted.tolist(), prop.n_draft.tolist()
        claimed = None  # what the drafter's probabilities expected of its verified drafts
        if "probability" in self.needs and prop.probability is not None:
            claimed = prop.probability.float().cumprod(dim=1).tolist()
        for r, req in enumerate(batch.reqs):
            a, copied = accepted[r], prop.copied[r]
            if copied:
                req.ngram.record_copy(drafted[r], a)
            elif prop.drafter_ran:
                self.record.add(a, drafted[r], seconds)
                if claimed is not None:
                    req.ngram.record_drafter(sum(claimed[r][: drafted[r]]), a)
            if req.ngram is not None:
                req.ngram.judge_shadow(req.output)

    def skip_drafter(self, batch) -> bool:
        """Whether this round goes without the drafter because it has not been paying (PayGate; only with a
        cost curve: draft_length=cost, or a gated proposer)."""
        return self.gate is not None and self.gate.skip(self.record, len(batch.reqs))
