"""Session: the learned state engines share when the caller wants them to, in one named object.

Boundary: owns, per proposer, the drafter's record (decoding/records.py DrafterRecord: its recent rounds
and the decayed copy / calibration history new requests start from) and, per target, the measured verify
cost curve (decoding/verify_cost.py). Nothing else: requests, caches and per-round state stay with the
engine.

Why an object the caller passes: engines are cheap and built per call (generate() builds one per batch),
but what they learn about a drafter and a machine is worth keeping across calls. Kept on the model
objects, it made two generate() calls over the same drafter behave differently with nothing in a
signature saying so. Now an engine without a session gets a fresh one of its own (calls are
independent); a caller that wants history carried over (a benchmark method over its prompts, eval over
its prompts, a server over its requests) passes the same Session to every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_trt.decoding.records import DrafterRecord
from dflash_trt.decoding.verify_cost import VerifyCost


@dataclass
class Session:
    # proposer name -> the drafter's record for engines of that proposer (one each, so that engines
    # choosing differently, a benchmark's methods over one drafter, do not learn from each other's rounds)
    records: dict[str, DrafterRecord] = field(default_factory=dict)
    # (id(target), tokens, tap layers) -> (target, its curve); the target is kept so that its id stays its own
    costs: dict[tuple, tuple[object, VerifyCost]] = field(default_factory=dict)

    def record(self, proposer: str) -> DrafterRecord:
        """The drafter's record for engines of this proposer (created on first use)."""
        return self.records.setdefault(proposer, DrafterRecord())

    def verify_cost(self, target, max_tokens: int, tap_layers: list[int]) -> VerifyCost:
        """The target's verify cost curve up to max_tokens scored tokens, measured on first use."""
        key = (id(target), max_tokens, tuple(tap_layers))
        if key not in self.costs:
            self.costs[key] = (target, VerifyCost.measure(target, max_tokens, tap_layers))
        return self.costs[key][1]
