"""proposer=ngram: every row verifies the continuation copied from its own text (prompt + output, the
suffix index of decoding/ngram.py); the drafter never runs (nor is its context injected). A row with no
earlier occurrence of its suffix takes a plain decode step.

Boundary: the choice only; the index is updated by the engine as tokens are emitted, the copy record
(decoding/records.py) by `observe`.
"""

from __future__ import annotations

from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.proposers.base import Proposer
from dflash_trt.decoding.records import MIN_MATCH
from dflash_trt.errors import DFlashError


class NgramProposer(Proposer):
    name = "ngram"
    uses_drafter = False
    copies = True
    variable = True

    @classmethod
    def check(cls, source, caps, label) -> None:
        if source not in (None, "cost"):
            raise DFlashError(
                "proposer=ngram: draft_cutoff / draft_length=confidence act on the drafter's drafts and this "
                "proposer has none; use draft_cutoff=0, draft_length=block"
            )

    def propose(self, batch) -> Proposal:
        B = batch.block_size
        prop = batch.copy_round([r.index.propose(B - 1, MIN_MATCH) for r in batch.reqs])
        prop.survivals = [r.ngram.survival(B - 1) for r in batch.reqs]
        return prop
