"""Cost-aware draft length (draft_length="cost"): per round, verify the width that maximises expected
emitted tokens per second, from the drafts' acceptance probabilities and this machine's verify cost.

Boundary: the cost curve (measured once per target and Session, decoding/session.py), the width
choice (tensors in, an int out) and the pay gate (whether the drafter runs a round at all).
Which probabilities feed it is the engine's choice (the confidence head where the drafter has one,
else the drafter's own probability of each draft, r^j for copied drafts).

A round that verifies width W (the last token and W-1 drafts) on R rows costs draft + verify(R * W)
seconds and emits R + sum_r sum_{j < W-1} s_r[j] tokens in expectation, where s_r[j] = P(drafts
1..j+1 of row r are all accepted) (the running product of per-draft acceptance probabilities). The
engine verifies every row at one width (one target pass), so one W is chosen for the batch: the
argmax of tokens / seconds over W = 1..B. Lossless: only how many drafts are judged changes, and the
choice reads the drafts' probabilities, never the target's verdict (decoding/draft_length.py).

Why a measured curve: a verify pass over W tokens costs about W times a 1-token step on a CPU once W
passes a few tokens, and about the same as one step on a GPU up to tens of tokens. On a GPU the curve
is flat and the choice is the whole block; on a CPU it is the short run the drafter is sure of.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# a drafter that has not been paying is still tried every 8th round, then every 16th, ... each time a try
# shows it still not paying, up to every 64th (exponential back-off: every try costs a draft pass and a
# wider verify, and off its training distribution a drafter rarely starts paying again)
PROBE_EVERY, PROBE_EVERY_MAX = 8, 64


@dataclass
class VerifyCost:
    """Seconds of one verify pass by total tokens scored (rows x width): points measured on this
    machine, linear in between and beyond the last."""

    tokens: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        t, s = self.tokens, self.seconds
        if n <= t[0]:
            return s[0]
        for i in range(1, len(t)):
            if n <= t[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (n - t[i - 1]) / (t[i] - t[i - 1])
        slope = (s[-1] - s[-2]) / (t[-1] - t[-2]) if len(t) > 1 else 0.0
        return s[-1] + slope * (n - t[-1])

    @classmethod
    def measure(cls, target, max_tokens: int, tap_layers: list[int], reps: int = 3, context: int = 32) -> VerifyCost:
        """Time target.forward over n = 1, 2, 4, ... max_tokens tokens after a `context`-token prefix
        (the median of `reps` passes each, after one warm-up), as the engine's verify calls it."""
        grid = sorted({1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens} | {max_tokens})
        cache = target.new_cache(1, context + max_tokens + 1)
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, target.vocab_size, (context,), generator=g).tolist()
        target.prefill([prefix], cache)
        base = cache.lengths.clone()
        seconds = []
        for n in grid:
            ids = torch.randint(0, target.vocab_size, (1, n), generator=g).to(target.device)
            times = []
            for _ in range(reps + 1):
                cache.crop(base)
                t0 = time.perf_counter()
                target.forward(ids, cache, tap_layers)
                _sync(target.device)
                times.append(time.perf_counter() - t0)
            seconds.append(sorted(times[1:])[len(times[1:]) // 2])
        cache.crop(base)
        return cls(grid, seconds)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def drafter_pays(mean_accepted: float, mean_width: float, draft_seconds: float, rows: int, cost: VerifyCost) -> bool:
    """Whether drafting has been paying: its rounds' expected tokens per second (1 + accepted drafts per
    row, at its mean verify width and draft time) at least a plain decode step's (1 token per cost(R)).
    Where it does not (a drafter off its training distribution, on a CPU), the engine takes plain steps
    and probes the drafter now and then, so output speed stays at least plain decoding's."""
    return (1.0 + mean_accepted) / (draft_seconds + cost(rows * mean_width)) >= 1.0 / cost(rows)


def best_width(survival: torch.Tensor, caps: torch.Tensor, cost: VerifyCost, draft_seconds: float) -> int:
    """The verify width W in 1..B maximising expected tokens per second for the batch.

    survival [R, B-1]  P(drafts 1..j+1 all accepted) per row
    caps     [R]       drafts each row can offer (copied continuations may be shorter than B-1)
    """
    R, n = survival.shape
    live = torch.arange(n, device=survival.device)[None] < caps[:, None]
    gain = torch.cat([survival.new_zeros(1), (survival.float() * live).sum(0).cumsum(0)]).tolist()  # [B]
    rates = [(R + gain[w - 1]) / (draft_seconds + cost(R * w)) for w in range(1, n + 2)]
    return 1 + max(range(len(rates)), key=rates.__getitem__)


class PayGate:
    """Whether the drafter runs this round: yes while drafting has been paying for itself against plain
    decode steps (drafter_pays over the drafter's record), else no, except for a probe every probe_every
    skipped rounds (PROBE_EVERY, doubling while the probes keep showing it not paying, up to
    PROBE_EVERY_MAX). Per engine: the skipped-round count is this engine's rounds."""

    def __init__(self, cost: VerifyCost):
        self.cost = cost
        self.skipped = 0  # rounds the drafter has been skipped since its last try
        self.probe_every = PROBE_EVERY  # skipped rounds before the next try

    def skip(self, record, rows: int) -> bool:
        """record: the drafter's (decoding/records.py DrafterRecord); rows: the batch's. Never before the
        drafter's first round (a drafter nobody has tried is tried)."""
        if not record.rounds:
            return False
        if drafter_pays(record.accepted, 1.0 + record.drafted, record.seconds, rows, self.cost):
            self.skipped, self.probe_every = 0, PROBE_EVERY
            return False
        self.skipped += 1
        if self.skipped < self.probe_every:
            return True
        self.skipped, self.probe_every = 0, min(2 * self.probe_every, PROBE_EVERY_MAX)  # probe this round
        return False
