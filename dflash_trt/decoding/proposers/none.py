"""proposer=none: no drafts; every round is a plain decode step through the same engine (its batching,
stop rule and statistics), so that a served baseline differs from the speculative engine in drafting
alone. The drafter is never run, nor its context injected.
"""

from __future__ import annotations

from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.proposers.base import Proposer
from dflash_trt.errors import DFlashError


class PlainProposer(Proposer):
    name = "none"
    uses_drafter = False
    variable = True  # every row verifies 0 drafts: a width-1 pass

    @classmethod
    def check(cls, source, caps, label) -> None:
        if source is not None:
            raise DFlashError(
                "proposer=none: plain decoding verifies no drafts, so draft_cutoff / draft_length do not apply; "
                "use draft_cutoff=0, draft_length=block"
            )

    def propose(self, batch) -> Proposal:
        return batch.copy_round([])
