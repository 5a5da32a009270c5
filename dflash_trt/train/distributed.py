"""Multi-process training (torchrun): the process group, each rank's share of a global batch, and the
gradient all-reduce that makes N ranks one optimizer.

Boundary: torch.distributed plumbing only; the trainer (train/trainer.py) decides what a batch is.
Design: every rank holds the whole drafter and optimizer and runs the same step sequence. Global
micro-batch i (batch_size sequences, the same list at any world size) is split into contiguous,
disjoint shares, one per rank; anchors are sampled for the whole global micro-batch from (seed, i) on
every rank and each rank keeps its rows, so no sample depends on the world size. Each rank's loss is
rescaled from its local normaliser to the global one (loss_scale) and the gradients are summed
(all_reduce_grads): the step equals a single process's on the whole batch, to float rounding. A
checkpoint then only needs the global step (train/checkpoint.py), so a run resumes at any world size.
Backends: gloo on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", "0"))


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_device(device: str) -> str:
    """Under torchrun with CUDA, each rank's own GPU (cuda:LOCAL_RANK) for 'auto' / 'cuda'."""
    if world_size() > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def setup(device: torch.device) -> bool:
    """Join the process group when WORLD_SIZE > 1 (once per process); whether training is distributed."""
    if world_size() <= 1:
        return False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if active():
        dist.barrier()


def share(items: list, r: int, world: int) -> slice:
    """Rank r's contiguous slice of a global micro-batch (equal shares when world divides it; a short
    last batch of an epoch gives some ranks one item fewer, or none)."""
    n = len(items)
    return slice(r * n // world, (r + 1) * n // world)


def loss_scale(local_den: float, global_den: float) -> float:
    """Factor turning a loss normalised by this rank's denominator into its part of the global loss
    (exactly 1.0 in a single process)."""
    return max(local_den, 1.0) / max(global_den, 1.0)


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the ranks' gradients (each already its share of the global mean). A parameter no rank
    reached keeps grad None everywhere, as in a single process; one some rank reached gets zeros
    on the others."""
    if not active():
        return
    dev = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has)
    for p, h in zip(params, has.tolist()):
        if h == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def global_mean(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of x (each rank's share of a global mean): the logged global loss."""
    if not active():
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x
