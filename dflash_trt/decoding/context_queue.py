"""The drafter's queue of target features not yet injected into its cache (the engine's `pending`).

Boundary: tensors in, tensors out. The engine decides when the queue is injected (every round the
drafter runs) and when it waits (rounds without the drafter: proposer=hybrid rounds with copies
only, and draft_length=cost rounds while drafting has not been paying).

Why a queue: injecting is a drafter pass over the new positions (fc + norm + every layer's K/V
projections). On a round without the drafter nothing reads those K/V until it runs again, and one
pass over the accumulated positions costs less than one pass per round: on this CPU the per-round
injection was most of what the hybrid proposer spent over proposer=ngram on text the drafter cannot
draft (1.3 against 0.1 ms per round, SmolLM2, WritingBench). A position's K/V depend only on its own
features and position, so injecting later writes the same cache.
"""

from __future__ import annotations

import torch

# a queue wider than this many blocks is injected even on a round without the drafter: it bounds the
# queue's memory (rows x width x taps*d) while still amortising the injection over several rounds
MAX_BLOCKS = 4


def append(
    pending: torch.Tensor, pending_n: torch.Tensor, taps: torch.Tensor, n_new: torch.Tensor, min_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new features queued after its waiting ones.

    pending   [R, P, F]  row r: its first pending_n[r] entries wait
    pending_n [R]
    taps      [R, W, F]  row r: its first n_new[r] entries are new (the rest is padding)
    n_new     [R]
    -> the queue [R, max(min_width, P, max(pending_n) + W), F] and its lengths pending_n + n_new [R]."""
    R, P, F = pending.shape
    W = taps.shape[1]
    width = max(min_width, P, int((pending_n + W).max()))
    out = taps.new_zeros(R, width, F)
    out[:, :P] = pending
    # every one of the W entries is written, at pending_n[r] + j: padding lands past the row's new length,
    # where nothing reads it, so no mask is needed
    idx = pending_n[:, None] + torch.arange(W, device=taps.device)  # [R, W]
    out.scatter_(1, idx[..., None].expand(-1, -1, F), taps)
    return out, pending_n + n_new.to(pending_n)


def pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [R, n, F] -> [R, max(n, width), F], zeros after the first n entries."""
    if x.shape[1] >= width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], x.shape[2])], dim=1)
