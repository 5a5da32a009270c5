"""Triton kernels for the DFlash drafter hot path, their PyTorch references and AOT compile.

Boundary: importing this package needs only torch. Triton is imported lazily, when a launcher
is first used, so CPU-only installs without the `kernels` extra still import dflash_trt.

  kv_inject(...)               (inject.py) context features -> K/V of all drafter layers into the caches
  block_draft_attention(...)   (attention.py) block queries vs [row context ; block K/V], flash-style, GQA
  greedy_accept(...)           (accept.py) greedy verification (argmax or logits input)
  rejection_accept(...)        (accept.py) lossless speculative sampling verification
  reference.*                  plain-PyTorch definitions the kernels are tested against
  aot.compile_all(...)         cubin + PTX + manifest.json for sm_90 / sm_100 / sm_120 (no GPU needed)

kernels_available() says whether the launchers can run here: Triton importable and either a
CUDA device or TRITON_INTERPRET=1 (Triton's CPU interpreter, used by the tests).

Kernel calling convention (all kernels): tensor inputs first, then int32 scalars (shape
numbers), then tensor outputs, then tl.constexpr specialisation knobs, so one AOT signature
(aot.py) describes every launch. All tensors are contiguous; strides are derived in-kernel.
The small helpers the launchers share (argument checks and packing) live in launching.py.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from dflash_trt.kernels.launching import interpreting

_LAUNCHERS = {
    "kv_inject": "dflash_trt.kernels.inject",
    "block_draft_attention": "dflash_trt.kernels.attention",
    "greedy_accept": "dflash_trt.kernels.accept",
    "rejection_accept": "dflash_trt.kernels.accept",
}

__all__ = ["kernels_available", "triton_available", *_LAUNCHERS]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_available() -> bool:
    """True when the Triton launchers can run: Triton installed and (CUDA or TRITON_INTERPRET=1)."""
    if not triton_available():
        return False
    return interpreting() or torch.cuda.is_available()


def __getattr__(name: str):
    if name in _LAUNCHERS:
        if not triton_available():
            raise ImportError(f"dflash_trt.kernels.{name} needs Triton: pip install 'dflash-trt[kernels]'")
        return getattr(importlib.import_module(_LAUNCHERS[name]), name)
    raise AttributeError(f"module 'dflash_trt.kernels' has no attribute {name!r}")
