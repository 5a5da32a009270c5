"""CUDA-graph replay of the drafter's half of propose(): inject last round's target features,
draft one block, project it through the LM head.

Why: on a GPU the eager drafter step is launch-bound. Measured on an H200 (Qwen3-8B drafter
shape, 5 layers, B=16, Triton kernels, scripts/gpu_check.py): 9.8 ms eager against 1.8 ms
replayed from a graph at batch 1, bit-identical output. The plain-PyTorch path cannot be
captured (its block attention reads the longest row length on the host), so graphs need
kernels="triton".

Boundary: this module owns the static input/output buffers and the graph; the engine owns the
cache and decides when to call. A graph is valid for one (batch rows, cache storage, block
shape) key; the engine's batch changes when requests join or finish (new cache tensors), and
then the next call recaptures (one graph is kept, so memory stays bounded). Weights must not
change after capture (inference only).

Contract of a replay, the same as the eager calls it stands for:
    drafter.inject_context(taps, num_new, cache); logits = drafter.draft_logits(block, cache)
with block = [last, MASK x (B-1)]; cache.lengths advances by num_new. The room check (a host
sync) runs before the replay, outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.families.capabilities import caps_of


def cuda_capture(fn: Callable[[], tuple]) -> tuple[object, tuple]:
    """fn captured into a torch.cuda.CUDAGraph -> (graph, fn's output tensors, static).
    Warm-up runs on a side stream first, as PyTorch requires (and to build lazy state such as
    stacked kernel weights outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class EagerReplay:
    """Stand-in for a CUDA graph where none can be captured (tests on CPU): replay() re-runs fn
    and writes its results into the first run's output tensors, so the caller sees exactly the
    static-buffer semantics of a real graph (outputs overwritten in place by every replay)."""

    def __init__(self, fn: Callable[[], tuple]):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        for dst, src in zip(self.out, self.fn()):
            dst.copy_(src)


def eager_capture(fn: Callable[[], tuple]) -> tuple[object, tuple]:
    g = EagerReplay(fn)
    return g, g.out


def graph_key(cache, taps: torch.Tensor) -> tuple:
    """What a captured graph's addresses depend on: rows, block shape, the cache's storage."""
    ptrs = tuple(t.data_ptr() for t in (*cache.k, *cache.v))
    return (tuple(taps.shape), taps.dtype, cache.max_len, ptrs)


class DrafterGraph:
    """inject_context + draft_logits for one batch, replayed from a captured graph."""

    def __init__(self, drafter, cache, taps: torch.Tensor, capture: Callable = cuda_capture):
        R, n, _ = taps.shape  # [R, n, taps*d]
        dev = cache.lengths.device
        self.drafter, self.cache, self.n = drafter, cache, n
        self.key = graph_key(cache, taps)
        self.taps = torch.zeros_like(taps)
        self.num_new = torch.zeros(R, dtype=torch.long, device=dev)
        self.last = torch.zeros(R, dtype=torch.long, device=dev)
        self.lengths = cache.lengths.clone()  # the lengths tensor the graph reads
        self.mask = torch.full((R, drafter.block_size), drafter.mask_token_id, dtype=torch.long, device=dev)
        keep = cache.lengths
        try:
            self.graph, (self.out_lengths, self.block, self.logits) = capture(self._step)
        finally:
            cache.lengths = keep  # capture ran the step on zero inputs: only scratch slots were touched

    def _step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cache
        c.lengths = self.lengths
        self.drafter.inject_context(self.taps, self.num_new, c)  # rebinds c.lengths (graph output)
        block = torch.where(
            torch.arange(self.mask.shape[1], device=self.mask.device) == 0, self.last[:, None], self.mask
        )
        return c.lengths, block, self.drafter.draft_logits(block, c)

    def __call__(self, taps: torch.Tensor, num_new: torch.Tensor, last: torch.Tensor):
        """taps [R, n, taps*d], num_new [R], last [R] -> (block [R, B] with column 0 = last,
        logits [R, B-1, V]). logits is the graph's buffer: read it before the next call."""
        c = self.cache
        c.check_room(self.n + self.drafter.block_size)
        self.lengths.copy_(c.lengths)
        self.taps.copy_(taps)
        self.num_new.copy_(num_new)
        self.last.copy_(last)
        self.graph.replay()
        c.lengths = self.out_lengths.clone()  # the graph overwrites its own buffer next replay
        return self.block.clone(), self.logits


class GraphedPropose:
    """Keeps at most one DrafterGraph and recaptures when the batch (its key) changes."""

    def __init__(self, drafter, capture: Callable = cuda_capture):
        self.drafter, self.capture = drafter, capture
        self.graph: DrafterGraph | None = None
        self.captures = 0

    def __call__(self, taps: torch.Tensor, num_new: torch.Tensor, last: torch.Tensor, cache):
        if self.graph is None or self.graph.cache is not cache or self.graph.key != graph_key(cache, taps):
            self.graph = None  # free the old graph's memory pool before capturing the next
            self.graph = DrafterGraph(self.drafter, cache, taps, self.capture)
            self.captures += 1
        return self.graph(taps, num_new, last)


def propose_graphs(mode: str, drafter, drafter_kernels: str, device, capture=None) -> GraphedPropose | None:
    """The engine's cuda_graph option: "auto" | "on" | "off" -> the graphed propose step, or None where it
    does not apply (graphs replay the Triton kernels' launches, so they need those kernels on a CUDA device;
    capture: tests' stand-in for cuda_capture)."""
    if mode not in ("auto", "on", "off"):
        raise DFlashError(f"cuda_graph={mode!r}: expected one of auto, on, off")
    on_gpu = torch.device(device).type == "cuda" or capture is not None
    family = getattr(drafter, "family", None)  # test doubles have none: graphed as plain DFlash
    graphed = family is None or caps_of(family).cuda_graph  # the family's CAPS says its step is graphed
    usable = drafter_kernels == "triton" and on_gpu and graphed
    if mode == "on" and not graphed:
        raise DFlashError(
            f"cuda_graph='on': the {family.LABEL} drafter step has no CUDA-graph replay (its CAPS.cuda_graph is "
            f"false); use cuda_graph='auto' or 'off'"
        )
    if mode == "on" and not usable:
        raise DFlashError(
            f"cuda_graph='on' needs the Triton kernels on a CUDA device (kernels in use: {drafter_kernels}, "
            f"device: {device}); use cuda_graph='auto' or 'off', or kernels='triton' on a GPU"
        )
    if mode == "off" or not usable:
        return None
    return GraphedPropose(drafter, capture or cuda_capture)
