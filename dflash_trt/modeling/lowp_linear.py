"""Native FP8 linears for the torch engine on GPUs with FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell).

Boundary: one module type (FP8Linear) and the swap of a loaded model's dequantized nn.Linear layers for it.
Reading the checkpoint is deploy/simulate.py's; this module only sees the FP8 tensors of the modules the
checkpoint quantized (Model Optimizer's HF layout: <m>.weight float8_e4m3fn [out, in], <m>.weight_scale f32
[] per tensor, <m>.input_scale f32 [] static activation scale). The product runs in torch._scaled_mm:
x_fp8 = saturate(x / input_scale), y = (x_fp8 @ w_fp8^T) * input_scale * weight_scale, accumulated in fp32 by
the tensor cores, output in the activation dtype: weights stay 1 byte each in GPU memory and the GEMM is an
FP8 one. Where it does not apply the engine keeps the dequantized nn.Linear (the exact weight rounding, bf16 /
fp32 arithmetic): CPUs, GPUs below sm_89, NVFP4 checkpoints (torch 2.13's _scaled_mm takes NVFP4 only as
blockwise-scaled float4_e2m1fn_x2 with swizzled scales on sm_100; not wired here), per-channel scales, and
shapes that are not multiples of 16 (cuBLASLt's FP8 requirement).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_CAPABILITY = (8, 9)


def native_fp8_reason(device: torch.device | str) -> str | None:
    """Why FP8 GEMMs cannot run natively on `device` (None: they can)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device {device} is not a CUDA GPU (FP8 GEMMs need sm_89+ tensor cores; CPU dequantizes)"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"GPU sm_{cap[0]}{cap[1]} has no FP8 tensor cores (sm_89+)"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no _scaled_mm"
    return None


class FP8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in FP8 E4M3 and x quantized to FP8 by a static per-tensor scale."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor, bias=None):
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2 or weight_scale.numel() != 1 or input_scale.numel() != 1:
            raise ValueError("FP8Linear takes an fp8 [out, in] weight with per-tensor weight and input scales")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight.contiguous())  # [out, in], row-major: .t() is column-major
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """cuBLASLt's FP8 GEMM needs both dimensions of the weight to be multiples of 16."""
        return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        xq = (x2.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        pad = -xq.shape[0] % 16  # _scaled_mm wants M a multiple of 16 as well
        if pad:
            xq = torch.cat([xq, xq.new_zeros(pad, self.in_features)])
        y = torch._scaled_mm(
            xq, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale, out_dtype=x.dtype
        )  # [M + pad, out]
        y = y[: x2.shape[0]]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def swap_in_fp8(model: nn.Module, qstate: dict[str, torch.Tensor], prefix: str = "") -> list[str]:
    """Replace every nn.Linear of `model` whose checkpoint entry `<prefix><name>` is FP8 with per-tensor
    weight and input scales by an FP8Linear on the linear's device; returns the swapped module names."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        key = prefix + name
        w, ws, xs = (qstate.get(f"{key}.{leaf}") for leaf in ("weight", "weight_scale", "input_scale"))
        if w is None or w.dtype != FP8 or ws is None or xs is None or ws.numel() != 1 or not FP8Linear.fits(w):
            continue
        dev = mod.weight.device
        new = FP8Linear(w.to(dev), ws.to(dev), xs.to(dev), mod.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        swapped.append(name)
    return swapped
