"""proposer=dflash: every round verifies the drafter's block (the paper's loop).

Boundary: the choice only; the drafter runs through the engine (batch.draft(): its family's propose,
families/), and with draft_length=cost a round goes without it while it has not been paying
(decoding/verify_cost.py PayGate): plain decode steps, probed now and then.
"""

from __future__ import annotations

from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.proposers.base import Proposer


class DFlashProposer(Proposer):
    name = "dflash"

    def propose(self, batch) -> Proposal:
        if self.skip_drafter(batch):
            return batch.copy_round([])  # plain steps
        return batch.draft()
