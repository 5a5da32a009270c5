"""Copied drafts: the n-gram proposer (every row's drafts copied from its own text, `place`) and the
hybrid proposer's `choose` rule: per row and round, verify the continuation copied from the row's own
text (decoding/ngram.py) instead of the drafter's block when it is expected to get more drafts
accepted.

Boundary: the choice, tensor in / tensor out over one round's proposal; the per-request n-gram index
and acceptance record live with the request in the engine.

Expected accepted drafts of a proposal whose draft j is accepted (given the earlier ones) with
probability a_j is sum_j prod_{i<=j} a_i. For the drafter's block, a_j is its own probability of
draft j (the "probability" confidence: for greedy rows the drafted token's, for sampled rows q's
top), scaled by the row's calibration (accepted / expected over its earlier drafter rounds); for
the n-gram continuation, a_j is the row's acceptance of copied draft j given the earlier ones
(NgramRecord.survival), which learns how well this request's text repeats itself. Both start from
the earlier requests' verdicts (DrafterRecord.start: a decayed history kept with the drafter, one
per proposer) rather than from nothing, so a request's first rounds are not decided by coin-flip
priors.

Lossless: the choice depends only on the past (the text, the drafter's q, earlier verdicts), never
on the target's verdict for this round. A copied draft is a point mass, q = 1 on the copied token,
so rejection sampling accepts it with probability p(token) and otherwise samples the residual, p
without that token (decoding/verify.py does exactly this for a one-hot q). Greedy rows accept a
draft when it is the target's argmax, whatever its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_trt.decoding.ngram import NgramProposal

# a copy needs a matched suffix of at least this many tokens: a single repeated token predicts its
# successor poorly (prompt lookup, HF's and vLLM's n-gram drafting, likewise match 2+ by default)
MIN_MATCH = 2


# a request's record starts from the shared history at this many pseudo-observations per copied
# position (and per expected drafter draft): enough that a new request copies from its first round
# where the earlier ones' copies were accepted, few enough that its own verdicts take over within a
# few rounds
PRIOR_WEIGHT = 8.0
# before any verdict at position j >= 1, a copied draft whose predecessors were accepted is taken to be
# accepted with this probability (at 2 pseudo-observations): copies are all or nothing, a copy that starts
# right tends to stay right (SmolLM2's ngram rounds: 0.77-0.88 per position after the first, the 1.5B
# coder's HumanEval copies: 0.98), while the first copied draft keeps the uninformed 1/2
CONTINUE_PRIOR = 0.8
# the shared history forgets geometrically per recorded round (memory of about 100 rounds, one or two
# requests), so that it follows the text at hand
HISTORY_DECAY = 0.99


@dataclass
class NgramRecord:
    """A record of both sources. Copied drafts: per position j, how often a copy reached it (every
    earlier copied draft accepted) and how often it was accepted there; the drafter's rounds: the
    accepted drafts its probabilities expected against those accepted. Counts are floats: a request's
    record starts from pseudo-counts (`DrafterRecord.start`), and the shared history decays.
    `history`: the shared record every verdict also goes to (None for the history itself)."""

    reached: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    drafter_expected: float = 0.0
    drafter_accepted: float = 0.0
    history: NgramRecord | None = None

    def record_copy(self, drafted: int, accepted: int) -> None:
        if self.history is not None:
            self.history.forget()
            self.history.record_copy(drafted, accepted)
        for j in range(min(accepted + 1, drafted)):
            if j == len(self.reached):
                self.reached.append(0.0)
                self.hits.append(0.0)
            self.reached[j] += 1
            self.hits[j] += float(j < accepted)

    def record_drafter(self, expected: float, accepted: int) -> None:
        if self.history is not None:
            self.history.forget()
            self.history.record_drafter(expected, accepted)
        self.drafter_expected += expected
        self.drafter_accepted += accepted

    def forget(self) -> None:
        k = HISTORY_DECAY
        self.reached = [k * x for x in self.reached]
        self.hits = [k * x for x in self.hits]
        self.drafter_expected *= k
        self.drafter_accepted *= k

    def survival(self, n: int) -> list[float]:
        """P(copied drafts 1..j+1 all accepted), j < n: the running product of the per-position
        acceptance given the earlier ones (2 pseudo-observations: 1/2 for the first, CONTINUE_PRIOR
        after). Per position, because copies are all or nothing: a copy that starts right tends to
        stay right, which one per-draft rate r (survival r^j) underestimates (on WritingBench it cut
        copies to under 2 drafts where 7 paid), and so does a uniform prior (1/2, 1/4, ...: the 1.5B
        coder's first copies were cut to 4-8 of 15 drafts, all of which were accepted)."""
        out, s = [], 1.0
        for j in range(n):
            reached, hits = (self.reached[j], self.hits[j]) if j < len(self.reached) else (0.0, 0.0)
            s *= (hits + 2 * (0.5 if j == 0 else CONTINUE_PRIOR)) / (reached + 2)
            out.append(s)
        return out

    @property
    def calibration(self) -> float:
        """Accepted / expected for the drafter's rounds (1 before any): a drafter's probabilities are
        its own belief, and a CPU-trained drafter off its training distribution is overconfident (on
        the `varied` bench set the bundled SmolLM2 drafter got 15% of its drafts accepted)."""
        return (self.drafter_accepted + 1.0) / (self.drafter_expected + 1.0)


@dataclass
class DrafterRecord:
    """The drafter's recent rounds, over every request it drafted for (kept on the drafter object, so
    engines built per call, as generate() builds them, share it): exponential moving means, so that
    it follows the text at hand (a drafter that does well on code and poorly on prose is judged by
    the prose while prose is being written). `history`: every request's copy and calibration
    verdicts, decayed, from which a new request's record starts (`start`)."""

    rounds: int = 0
    accepted: float = 1.0  # mean accepted drafts per round; optimistic before any: a new drafter gets tried
    drafted: float = 0.0  # mean drafts verified per round
    seconds: float = 0.0  # mean time of a drafting round
    decay: float = 0.9
    history: NgramRecord = field(default_factory=NgramRecord)

    def add(self, accepted: int, drafted: int, seconds: float) -> None:
        k = 0.0 if not self.rounds else self.decay
        self.accepted = k * self.accepted + (1 - k) * accepted
        self.drafted = k * self.drafted + (1 - k) * drafted
        self.seconds = k * self.seconds + (1 - k) * seconds
        self.rounds += 1

    def start(self) -> NgramRecord:
        """A new request's record: the history's per-position copy acceptance and the drafter's
        calibration, each at most PRIOR_WEIGHT pseudo-observations. Why: a request's own record
        starts empty, so its first copies look like coin flips (survival 1/2, 1/4, ...) and the
        cost-aware length cuts them short; on the 1.5B coder's HumanEval answers, which copy the
        prompt at length, hybrid verified 7.6 drafts per copy round against ngram's 15 (all of them
        accepted) and ran at 0.81x of proposer=ngram (bf16, docs/performance.md)."""
        h = self.history
        rec = NgramRecord(history=h)
        for reached, hits in zip(h.reached, h.hits):
            w = min(PRIOR_WEIGHT, reached)
            rec.reached.append(w)
            rec.hits.append(w * hits / reached if reached else 0.0)
        if h.drafter_expected > 0:
            w = min(PRIOR_WEIGHT, h.drafter_expected)
            rec.drafter_expected, rec.drafter_accepted = w, w * h.drafter_accepted / h.drafter_expected
        return rec


def record_of(drafter, proposer: str = "dflash") -> DrafterRecord:
    """The drafter's record for engines of one proposer: kept on the drafter object (engines built per
    call share it), one per proposer so that engines choosing differently (a benchmark's methods over
    one drafter) do not learn from each other's rounds."""
    return drafter.__dict__.setdefault("_hybrid_records", {}).setdefault(proposer, DrafterRecord())


def copies_win(proposals: list[NgramProposal], survivals: list[list[float]], record: DrafterRecord) -> bool:
    """Skip the drafter this round: every row has a copy expected to get at least as many drafts
    accepted as the drafter has been getting per round (drafting costs a forward pass for the batch,
    so it is skipped only when no row needs it). Never before the drafter's first round: a drafter
    nobody has tried is tried once, whatever the copies' priors promise."""
    if not record.rounds:
        return False
    return all(p.tokens and sum(surv[: len(p.tokens)]) >= record.accepted for p, surv in zip(proposals, survivals))


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
