"""The target layer's operations with few dispatches: what modeling/target.py's forward calls per layer.

Boundary: numerics only, no state. Each function computes what the Hugging Face module it stands in
for computes, with fewer PyTorch operations, because a CPU decode step (one token) is dominated by
per-operation cost, not arithmetic: SmolLM2-135M runs ~3,300 aten operations per token through the
HF modules (docs/performance.md "Plain decode step"). Where a shortcut would change float32 results
(another reduction order, a fused multiply-add), it is not taken:

  rms_norm    torch's composite rms_norm: the same pow / mean / rsqrt / mul sequence as Llama /
              Qwen2 / Qwen3 RMSNorm, run in C++ (bit-identical in float32; other dtypes, and any other
              norm class, go through the module, whose casts differ).
  linear      F.linear on a plain nn.Linear's weight (skips nn.Module.__call__); other modules
              (PackedLinear, quantised linears) are called.
  rope_qk     q and k rotated in one pass when they come out of one tensor; rotate_half as one flip
              with the sign folded into sin: (-x2) * sin == x2 * (-sin) exactly, so the result is the
              HF formula's, bit for bit.
  mlp         the gated MLP (SiLU) without the module calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})  # same forward (checked in tests)


def rms_norm(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x) for the target's RMSNorm modules; x [..., d]."""
    if x.dtype == torch.float32 and type(mod).__name__ in _RMS_NORMS:
        return F.rms_norm(x, mod.weight.shape, mod.weight, mod.variance_epsilon)
    return mod(x)


def linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x) for a projection; x [..., in] -> [..., out]."""
    if type(mod) is nn.Linear:
        return F.linear(x, mod.weight, mod.bias)
    return mod(x)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] -> [-sin[..., :D/2], sin[..., D/2:]]: rotate_half's sign moved onto sin (exact)."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_s: torch.Tensor) -> torch.Tensor:
    """x [R, n, H, D]; cos / sin_s (signed_sin) [R, n, 1, D] -> x * cos + rotate_half(x) * sin."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin_s


def mlp(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's gated MLP, down(act(gate(x)) * up(x)); x [..., d]."""
    if not isinstance(getattr(mod, "act_fn", None), nn.SiLU):
        return mod(x)
    return linear(mod.down_proj, F.silu(linear(mod.gate_proj, x)) * linear(mod.up_proj, x))
