"""The drafter's queue of target features not yet injected into its cache (the engine's `pending`).

Boundary: tensors in, tensors out. The engine decides when the queue is injected (every round the
drafter runs) and when it waits (rounds without the drafter: proposer=hybrid rounds with copies
only, and draft_length=cost rounds while drafting has not been paying).

Why a queue: injecting is a drafter pass over the new positions (fc + norm + every layer's K/V
projections). On a round without the drafter nothing reads those K/V until it runs again, and one
pass over the accumulated positions costs less than one pass per round (on a CPU the per-round
injection was most of what the hybrid spent over proposer=ngram on text the drafter cannot draft:
docs/performance.md#copied-drafts-n-gram-and-hybrid-proposers). While the drafter is not run, it costs
nothing but the queue's memory (the lazy upkeep: the queue doubles in place, and is injected only when
the drafter runs again or the queue reaches MAX_BYTES). A position's K/V depend only on its own
features and position, so injecting later writes the same cache.
"""

from __future__ import annotations

import torch

# a queue is injected on a round without the drafter only once it would pass this many bytes (rows x width x
# taps*d x element size) and at least MIN_BLOCKS blocks: while copies alone pay (or plain steps), the drafter
# costs nothing but the queue's memory, and its context is caught up lazily when it next runs
MAX_BYTES = 64 << 20
MIN_BLOCKS = 4


def full(pending: torch.Tensor, block_size: int) -> bool:
    """pending [R, P, F]: whether the queue has reached its bound (MAX_BYTES, at least MIN_BLOCKS blocks)."""
    R, P, F = pending.shape
    return P >= max(MIN_BLOCKS * block_size, MAX_BYTES // max(1, R * F * pending.element_size()))


def append(
    pending: torch.Tensor, pending_n: torch.Tensor, taps: torch.Tensor, n_new: torch.Tensor, min_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new features queued after its waiting ones.

    pending   [R, P, F]  row r: its first pending_n[r] entries wait
    pending_n [R]
    taps      [R, W, F]  row r: its first n_new[r] entries are new (the rest is padding)
    n_new     [R]
    -> the queue [R, P' >= max(min_width, max(pending_n) + W), F] (pending itself, written in place, while it
    has room; else twice as wide) and its lengths pending_n + n_new [R]."""
    R, P, F = pending.shape
    W = taps.shape[1]
    need = int((pending_n + W).max())
    # room left in a queue this function allocated (wider than min_width: never the target's own features):
    # write in place, so that a queue grows by doubling, not by a copy per round
    if need <= P and P > min_width:
        out = pending
    else:
        out = taps.new_zeros(R, max(min_width, need, 2 * P), F)
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
