"""What every kernel launcher shares: the interpreter check, device checks and argument packing.

Boundary: plain torch, no Triton, no launcher. The launcher modules (inject.py, attention.py,
accept.py) import these from here, not from the package, because the package loads the launchers
on first use (kernels/__init__.py), so a launcher importing the package would close an import cycle.
"""

from __future__ import annotations

import os

import torch

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
