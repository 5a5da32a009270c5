"""How many of a block's drafts to verify: all of them, or the leading run the drafter is sure of.

Boundary: a pure policy on the drafter's own probabilities, [R, B-1] in, [R] out. It never looks at
the target, so greedy output stays the target's greedy output. With sampling, the confidence must
be q's top probability at each position, not q of the token actually drawn: a length that depends
on the drawn drafts keeps a draft only when it is a likely one, so a kept draft is no longer
distributed as q and rejection sampling by q stops being lossless (tests/test_draft_length.py
shows the bias). DFlash drafts every position in one pass from the same context, so q does not
depend on the drawn drafts and a length chosen from q alone leaves each accept test exact.

Why: a verify pass over W tokens costs about W times as much on a CPU as a 1-token decode step
when W is small, while on a GPU it costs the same up to tens of tokens (measurements:
docs/performance.md#draft-cutoff-verify-only-the-sure-drafts-2026-12-06). The drafter's confidence
predicts acceptance well: drafts it gives a low probability are rarely accepted. Verifying only
the drafts whose cumulative confidence (the running product of the drafter's probabilities, a rough
P(all of them are accepted)) stays at or above a cutoff spends verify
width where it is likely to pay. A step with no confident draft verifies the last token alone:
exactly a plain decode step. cutoff 0 verifies the whole block (the paper's loop).
"""

from __future__ import annotations

import torch

from dflash_trt.errors import ConfigError


def check_cutoff(cutoff: float, name: str = "draft_cutoff") -> float:
    """The cutoff, or a ConfigError naming `name` (the field or flag it came from)."""
    if not 0.0 <= cutoff < 1.0:
        sep = " " if name.startswith("--") else "="
        raise ConfigError(f"{name}{sep}{cutoff}: choose 0 <= cutoff < 1 (0 verifies every draft)")
    return float(cutoff)


DRAFT_LENGTHS = ("block", "confidence", "cost")


def length_source(draft_length: str, cutoff: float, name: str = "draft_length") -> str | None:
    """How the engine sets the draft length: None (verify the whole block), "probability" (the
    drafter's own probabilities, cutoff > 0), "confidence" (a learned acceptance head, DSpark's; the
    cutoff is then the threshold on its predicted chance that every kept draft is accepted) or
    "cost" (the width with the most expected tokens per second, decoding/verify_cost.py).
    ConfigError naming `name` otherwise."""
    if draft_length not in DRAFT_LENGTHS:
        raise ConfigError(f"{name}={draft_length!r}: choose one of {', '.join(DRAFT_LENGTHS)}")
    if draft_length == "cost":  # decoding/verify_cost.py
        if cutoff > 0:
            raise ConfigError(
                f"{name}=cost chooses how many drafts to verify from this machine's verify cost; it takes no "
                f"draft_cutoff (got {cutoff}): use draft_cutoff=0"
            )
        return "cost"
    if draft_length == "confidence":
        if cutoff <= 0:
            raise ConfigError(
                f"{name}=confidence needs draft_cutoff > 0: the threshold on the confidence head's predicted "
                f"chance that every kept draft is accepted (e.g. 0.3)"
            )
        return "confidence"
    return "probability" if cutoff > 0 else None


def draft_lengths(conf: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Drafts to verify per row.

    conf:   [R, B-1] the drafter's top probability at each block position (for greedy drafts, the
            probability of the drafted token).
    cutoff: keep draft i while conf[0] * ... * conf[i] >= cutoff.
    -> [R] int64 in 0..B-1, the length of that leading run (B-1 for every row when cutoff is 0).
    """
    if cutoff <= 0.0:
        return torch.full(conf.shape[:1], conf.shape[1], dtype=torch.long, device=conf.device)
    return (conf.float().cumprod(dim=1) >= cutoff).sum(dim=1)  # the product never grows: a prefix
