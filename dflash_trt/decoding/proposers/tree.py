"""proposer=tree: per row, the drafter's block and the continuation copied from the row's own text, both
verified in ONE target pass as a token tree (decoding/tree.py: layout, tree-masked verify, branch choice);
the longer accepted branch is kept.

Boundary: the proposal (a Proposal carrying the Tree: node tokens, ancestor mask, branch map) and what the
verdicts teach the records; the engine verifies the tree, compacts its cache to the kept branch and queues
that branch's features for the drafter. Rounds where no row has a copy are plain chain verifies of the
drafter's block; rounds where every row's copy is expected to beat the drafter go without it (copies only,
as for hybrid).
"""

from __future__ import annotations

from dflash_trt.decoding import tree
from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.proposers.base import Proposer
from dflash_trt.decoding.proposers.hybrid import copies_win, refuse_unless_hybrid
from dflash_trt.decoding.records import MIN_MATCH
from dflash_trt.decoding.verify import Verdict
from dflash_trt.errors import DFlashError


class TreeProposer(Proposer):
    name = "tree"
    copies = True
    cache_blocks = 2
    needs = frozenset({"probability"})
    variable = True

    @classmethod
    def check(cls, source, caps, label) -> None:
        if source == "cost":
            raise DFlashError(
                "proposer=tree: draft_length=cost prices a chain verify, not a two-branch tree; use "
                "draft_length=block or proposer=hybrid"
            )
        refuse_unless_hybrid(cls.name, caps, label)

    def propose(self, batch) -> Proposal:
        B, reqs = batch.block_size, batch.reqs
        proposals = [r.index.propose(B - 1, MIN_MATCH) for r in reqs]
        survivals = [r.ngram.survival(B - 1) for r in reqs]
        if copies_win(proposals, survivals, self.record):
            prop = batch.copy_round(proposals)
        else:
            prop = batch.draft()
            copies = tree.branches(proposals)  # every row's copy is verified beside the block, no choice
            if copies is not None:
                prop.tree = tree.build(prop.block, prop.n_draft, copies, batch.drafter.mask_token_id)
        prop.survivals = survivals
        return prop

    def observe(self, batch, prop: Proposal, verdict: Verdict, seconds: float) -> None:
        """The kept branches as for a chain; for greedy rows also the losing branch's verdict (prop.losers),
        so that the copy survival and the drafter's record see every branch judged. A sampled row's losing
        branch has no verdict of its own (two_branch_accept judges the two together): only its kept one."""
        for r, lost in (prop.losers or {}).items():
            n_drafter, n_copy = prop.tree.n_draft[r].tolist()
            if prop.copied[r]:  # the copy's branch won: the drafter's lost
                self.record.add(lost, n_drafter, batch.draft_seconds)
            else:
                batch.reqs[r].ngram.record_copy(n_copy, lost)
        super().observe(batch, prop, verdict, seconds)
