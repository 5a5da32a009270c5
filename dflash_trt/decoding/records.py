"""Learned state of the copying proposers (ngram, hybrid, tree): how copied drafts and the drafter's
drafts have fared. `NgramRecord` is one request's (kept with the request); `DrafterRecord` is the
drafter's recent rounds and the decayed history every request's record starts from, owned by a
`Session` (decoding/session.py: the engine's own, or one the caller passes to share it across calls),
one per proposer.

Boundary: counts in, estimates out (survival of copied drafts, the drafter's calibration); no tensors,
no model. How the estimates choose between sources is decoding/proposers/hybrid.py's business.

Expected accepted drafts of a proposal whose draft j is accepted (given the earlier ones) with
probability a_j is sum_j prod_{i<=j} a_i. For the drafter's block, a_j is its own probability of
draft j, scaled by the row's calibration (accepted / expected over its earlier drafter rounds); for
the n-gram continuation, a_j is the row's acceptance of copied draft j given the earlier ones
(NgramRecord.survival), which learns how well this request's text repeats itself. Both start from
the earlier requests' verdicts (DrafterRecord.start) rather than from nothing, so a request's first
rounds are not decided by coin-flip priors. Measurements behind the constants: docs/performance.md
("Copied drafts").
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
# right tends to stay right (per-position acceptance after the first: docs/performance.md, "Copied
# drafts"), while the first copied draft keeps the uninformed 1/2
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
    # a copy offered but not verified (a plain step was cheaper): its tokens and the output length when it
    # was offered, judged against the output as it arrives (`judge_shadow`)
    shadow: tuple[list[int], int] | None = None

    def judge_shadow(self, output: list[int]) -> None:
        """Record the unverified copy once the output shows how much of it the target would have accepted.
        Exact for greedy rows (the output is the target's greedy continuation); for sampled rows the chance
        that the sample equals the copied token is p(token), the chance rejection sampling accepts a point-mass
        draft, so the count has the verified copy's distribution. Why: without it a copy record that once
        fell below a plain step's worth would never be tried again."""
        if self.shadow is None:
            return
        toks, n = self.shadow
        seen = output[n : n + len(toks)]
        m = 0
        while m < len(seen) and seen[m] == toks[m]:
            m += 1
        if m < len(seen) or len(seen) == len(toks):  # a mismatch, or the whole copy seen
            self.record_copy(len(toks), m)
            self.shadow = None

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
        stay right, which one per-draft rate r (survival r^j) underestimates, cutting long copies that
        would have been accepted, and so does a uniform prior (1/2, 1/4, ...; docs/performance.md)."""
        out, s = [], 1.0
        for j in range(n):
            reached, hits = (self.reached[j], self.hits[j]) if j < len(self.reached) else (0.0, 0.0)
            s *= (hits + 2 * (0.5 if j == 0 else CONTINUE_PRIOR)) / (reached + 2)
            out.append(s)
        return out

    @property
    def calibration(self) -> float:
        """Accepted / expected for the drafter's rounds (1 before any): a drafter's probabilities are
        its own belief, and a drafter off its training distribution is overconfident."""
        return (self.drafter_accepted + 1.0) / (self.drafter_expected + 1.0)


@dataclass
class DrafterRecord:
    """The drafter's recent rounds, over every request it drafted for (owned by a Session, so that
    engines built per call, as generate() builds them, share it only when the caller passes one):
    exponential moving means, so that it follows the text at hand (a drafter that does well on code and
    poorly on prose is judged by the prose while prose is being written). `history`: every request's copy
    and calibration verdicts, decayed, from which a new request's record starts (`start`)."""

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
        cost-aware length cuts them short where the prompt is copied at length (docs/performance.md)."""
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
