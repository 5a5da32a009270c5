"""Triton kernels for the DFlash drafter hot path, their PyTorch references, AOT and TRT plugins.

Boundary: importing this package needs only torch. Triton is imported lazily, when a launcher
is first used, so CPU-only installs without the `kernels` extra still import dflash_trt.

  kv_inject(...)               (inject.py) context features -> K/V of all drafter layers into the caches
  block_draft_attention(...)   (attention.py) block queries vs [row context ; block K/V], flash-style, GQA
  greedy_accept(...)           (accept.py) greedy verification (argmax or logits input)
  rejection_accept(...)        (accept.py) lossless speculative sampling verification
  reference.*                  plain-PyTorch definitions the kernels are tested against
  aot.compile_all(...)         cubin + PTX + manifest.json for sm_90 / sm_100 / sm_120
  trt_plugins.register_plugins()   TensorRT quickly-deployable AOT plugins (NGC container only)

kernels_available() says whether the launchers can run here: Triton importable and either a
CUDA device or TRITON_INTERPRET=1 (Triton's CPU interpreter, used by the tests).

Kernel calling convention (all kernels): tensor inputs first, then int32 scalars (shape
numbers), then tensor outputs, then tl.constexpr specialisation knobs. This is the order
TensorRT's AOT quickly-deployable plugins launch a kernel in (inputs, extra int args,
outputs), so the same compiled PTX serves both the Python launchers and the engine.
All tensors are contiguous (TensorRT passes linear tensors); strides are derived in-kernel.
The small helpers below are shared by the launchers (argument checks and packing).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

_LAUNCHERS = {
    "kv_inject": "dflash_trt.kernels.inject",
    "block_draft_attention": "dflash_trt.kernels.attention",
    "greedy_accept": "dflash_trt.kernels.accept",
    "rejection_accept": "dflash_trt.kernels.accept",
}

__all__ = ["kernels_available", "triton_available", *_LAUNCHERS]


FP8 = torch.float8_e4m3fn  # fp8 caches store x / scale, saturated to +-448


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int, at_least: int = 16) -> int:
    p = at_least
    while p < n:
        p *= 2
    return p


def check_device(*tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return dev


def need_contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    """Caches are written in place, so they must already be contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (kernels derive strides from shapes)")
    return t


def scale_tensor(kv_scale, device) -> torch.Tensor:
    """kv_scale (None, float, or 1-2 element tensor) -> fp32 [2] = (k_scale, v_scale)."""
    if kv_scale is None:
        return torch.ones(2, dtype=torch.float32, device=device)
    s = torch.as_tensor(kv_scale, dtype=torch.float32, device=device).flatten()
    if s.numel() == 1:
        s = s.repeat(2)
    if s.numel() != 2:
        raise ValueError(f"kv_scale must have 1 or 2 elements, got {s.numel()}")
    return s.contiguous()


def int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def dummy_i32(device) -> torch.Tensor:
    """Stand-in for an absent int32 input (e.g. block_table of a contiguous cache)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


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
