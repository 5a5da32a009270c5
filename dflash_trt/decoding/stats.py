"""DecodeStats: the one record of a speculative-decoding run's statistics, per request and aggregate.

Boundary: counting and the definitions derived from the counts (tau, acceptance rate, per-position
acceptance, the accept histogram, decode speed). Nothing here runs a model. The engine records one
per request (decoding/engine.py), generate() adds them into the batch's (decoding/loop.py), and
every consumer (bench, serving outputs and metrics, quickstart, CLI, train/evaluate, deploy eval)
reads these properties rather than re-deriving them.

Definitions (B = block size; a verify step = one target pass after prefill):
  tau                 tokens per verify step, bonus token included: (accepted drafts + steps) / steps,
                      the DFlash paper's acceptance length (its reference loop counts accept + 1 per
                      step before any truncation at a stop token); 1 for plain decoding, 0 before any
                      step. A step that verified no drafts (--draft-cutoff) still counts, as 1 token.
  acceptance rate     accepted drafts / drafts the target judged (fewer than steps x (B-1) when gated)
  accept_hist[k]      verify steps whose verdict was k tokens (k-1 accepted drafts + the bonus), k 1..B
  accepted_at[i]      verify steps whose draft i+1 was accepted; per-position acceptance divides it
                      by the steps
  copied              proposer=hybrid: the verify steps whose drafts were copied from the row's own
                      text (decoding/hybrid.py), their drafts and accepted drafts (also counted in
                      the totals above); the drafter's share is the difference
  tree                proposer=tree (decoding/tree.py): a round that verified both a copy and the drafter's
                      block as one tree counts above as one step of the branch it kept (its drafts,
                      accepted drafts, copied or not); num_tree_steps counts those rounds,
                      num_tree_draft_tokens every draft they judged (both branches, shared prefix once, so
                      at least the kept branch's drafts), num_tree_copy_wins the rounds that kept the copy
                      (also counted in copied)
  predicted_at[i]     drafters with a confidence head (DSpark): the sum over verify steps of its
                      predicted P(draft i+1 is accepted) (the running product of its per-position
                      predictions; 0 where the draft was not verified), so predicted_per_position
                      and predicted_tau compare with per_position_acceptance and tau
The counts are the verdict's: drafts accepted past a stop token or the token budget count, though
the emitted output stops there (so tau need not equal (output tokens - 1) / steps on a row's last
step). Earlier copies disagreed here only for plain decoding (tau 0 vs 1); 1 is the definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_trt.errors import DFlashError

_COUNTS = (
    "num_prompt_tokens",
    "num_output_tokens",
    "num_verify_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "num_copied_steps",
    "num_copied_draft_tokens",
    "num_accepted_copied_tokens",
    "num_tree_steps",
    "num_tree_draft_tokens",
    "num_tree_copy_wins",
)
_TIMES = ("prefill_time", "draft_time", "verify_time", "wall_time")


def tau(accepted_drafts: int, verify_steps: int) -> float:
    """Acceptance length: tokens per verify step, bonus included (0.0 before any step)."""
    return (accepted_drafts + verify_steps) / verify_steps if verify_steps else 0.0


def acceptance_rate(accepted_drafts: int, drafts: int) -> float:
    """Share of the drafts the target judged that it accepted (0.0 when none were judged)."""
    return accepted_drafts / drafts if drafts else 0.0


def add_lists(a: list, b: list) -> list:
    """Element-wise sum of two count lists of any lengths (the shorter padded with 0)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class DecodeStats:
    block_size: int = 0  # 0: plain decoding, or an aggregate nothing has been added to yet
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_verify_steps: int = 0  # target passes after prefill (decode steps for plain decoding)
    num_draft_tokens: int = 0  # drafts the target judged
    num_accepted_draft_tokens: int = 0
    num_copied_steps: int = 0  # proposer=hybrid: steps that verified drafts copied from the text
    num_copied_draft_tokens: int = 0
    num_accepted_copied_tokens: int = 0
    num_tree_steps: int = 0  # proposer=tree: verify steps over a two-branch tree (see the module docstring)
    num_tree_draft_tokens: int = 0
    num_tree_copy_wins: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [k] = verify steps that emitted k tokens (1..B)
    accepted_at: list[int] = field(default_factory=list)  # [i] = steps whose draft i+1 was accepted
    predicted_at: list[float] = field(default_factory=list)  # [i] = sum of predicted P(draft i+1 accepted)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0

    def __post_init__(self):
        if self.block_size < 0:
            raise DFlashError(f"DecodeStats.block_size={self.block_size}: must be >= 0 (0 = plain decoding)")
        if self.block_size:  # sized up front so that record() can index them
            self.accept_hist = list(self.accept_hist) or [0] * (self.block_size + 1)
            self.accepted_at = list(self.accepted_at) or [0] * (self.block_size - 1)

    @classmethod
    def from_hist(cls, hist: list[int], drafts: int = 0) -> DecodeStats:
        """Counts implied by an accept histogram alone (methods that only see tokens per pass, e.g.
        HF generate through a streamer): hist[k] = passes that emitted k tokens."""
        hist = list(hist)
        B = max(len(hist) - 1, 0)
        return cls(
            block_size=B,
            num_verify_steps=sum(hist),
            num_draft_tokens=drafts,
            num_accepted_draft_tokens=sum(k * h for k, h in enumerate(hist)) - sum(hist),
            accept_hist=hist or [0] * (B + 1),
            accepted_at=[sum(hist[i + 2 :]) for i in range(max(B - 1, 0))],
        )

    def record(self, accepted: int, drafted: int, predicted: list[float] | None = None, copied: bool = False) -> None:
        """One verify step that judged `drafted` drafts and accepted the first `accepted` of them;
        predicted: the confidence head's P(draft i+1 accepted) for the judged drafts, when it has one;
        copied: the drafts came from the row's own text (proposer=hybrid), not the drafter."""
        if not 0 <= accepted <= drafted < max(self.block_size, 1):
            raise DFlashError(
                f"DecodeStats.record(accepted={accepted}, drafted={drafted}): need "
                f"0 <= accepted <= drafted < block_size={self.block_size}"
            )
        self.num_verify_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += accepted
        self.accept_hist[accepted + 1] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        if copied:
            self.num_copied_steps += 1
            self.num_copied_draft_tokens += drafted
            self.num_accepted_copied_tokens += accepted
        if predicted is not None:
            if not self.predicted_at:
                self.predicted_at = [0.0] * (self.block_size - 1)
            for i, p in enumerate(predicted[:drafted]):
                self.predicted_at[i] += p

    def record_tree(self, judged: int, copy_won: bool) -> None:
        """One tree round (proposer=tree), besides its record() of the kept branch: `judged` drafts in
        both branches (shared prefix once); copy_won: the copy's branch was kept."""
        self.num_tree_steps += 1
        self.num_tree_draft_tokens += judged
        self.num_tree_copy_wins += int(copy_won)

    @property
    def tau(self) -> float:
        """Acceptance length: tokens per verify step, bonus included (see the module docstring)."""
        return tau(self.num_accepted_draft_tokens, self.num_verify_steps)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_draft_tokens, self.num_draft_tokens)

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft i is accepted) for i = 1..B-1, over all verify steps."""
        s = self.num_verify_steps
        return [c / s for c in self.accepted_at] if s else []

    @property
    def predicted_per_position(self) -> list[float]:
        """The confidence head's mean predicted P(draft i is accepted), i = 1..B-1 ([] without one)."""
        s = self.num_verify_steps
        return [p / s for p in self.predicted_at] if s and self.predicted_at else []

    @property
    def predicted_tau(self) -> float | None:
        """The tau the confidence head predicted (None without one): 1 + its expected accepted drafts."""
        per = self.predicted_per_position
        return 1.0 + sum(per) if per else None

    @property
    def sources(self) -> dict[str, dict[str, int]]:
        """Steps, drafts and accepted drafts per draft source: the drafter and copied text (hybrid)."""
        copied = (self.num_copied_steps, self.num_copied_draft_tokens, self.num_accepted_copied_tokens)
        total = (self.num_verify_steps, self.num_draft_tokens, self.num_accepted_draft_tokens)
        keys = ("steps", "drafts", "accepted")
        return {
            "drafter": dict(zip(keys, (t - c for t, c in zip(total, copied)))),
            "copied": dict(zip(keys, copied)),
        }

    @property
    def drafts_per_step(self) -> float:
        """Drafts the target judged per verify step (B-1, or fewer with a draft cutoff)."""
        s = self.num_verify_steps
        return self.num_draft_tokens / s if s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        dt = self.wall_time - self.prefill_time
        return (self.num_output_tokens - 1) / dt if dt > 0 and self.num_output_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            drafts_per_step=self.drafts_per_step,
            per_position_acceptance=self.per_position_acceptance,
            predicted_per_position=self.predicted_per_position,
            predicted_tau=self.predicted_tau,
            sources=self.sources,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d

    def add(self, s: DecodeStats) -> None:
        """Add another's token and step counts (not times): per-request stats into a batch's."""
        self.block_size = s.block_size or self.block_size
        for k in _COUNTS:
            setattr(self, k, getattr(self, k) + getattr(s, k))
        self.accept_hist = add_lists(self.accept_hist, s.accept_hist)
        self.accepted_at = add_lists(self.accepted_at, s.accepted_at)
        self.predicted_at = add_lists(self.predicted_at, s.predicted_at)

    def merge(self, other: DecodeStats) -> None:
        """Add another run's counts and times (runs one after another, e.g. over a prompt set)."""
        self.add(other)
        for k in _TIMES:
            setattr(self, k, getattr(self, k) + getattr(other, k))
