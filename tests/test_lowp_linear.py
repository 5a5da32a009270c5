"""Native FP8 linears (modeling/lowp_linear.py): the GPU path, and the CPU keeping the dequantized one.

The `gpu` tests run where PyTorch sees an sm_89+ device (tests/conftest.py skips `gpu` elsewhere; an older
GPU skips with the reason). Tolerance of FP8Linear vs the dequantized linear: both use the same FP8 weight;
FP8Linear also rounds x to E4M3 (relative error <= 2^-4 per element, half an ulp at 3 mantissa bits) and
accumulates in fp32, so |y - y_ref| <= 2^-4 * sum_i |x_i w_i| (+ bf16 output rounding 2^-8 |y|).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trt.deploy import formats as F
from dflash_trt.modeling.lowp_linear import FP8Linear, native_fp8_reason, swap_in_fp8


def fp8_layer(out_f=64, in_f=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    ws = F.fp8_scale(w)
    x = torch.randn(5, 3, in_f, generator=g)
    xs = F.input_scale_from_amax(x.abs().max(), "FP8")
    return F.fp8_quantize(w, ws), ws, xs, x


def test_cpu_keeps_the_dequantized_linear():
    assert "not a CUDA GPU" in native_fp8_reason("cpu")
    lin = nn.Sequential(nn.Linear(128, 64, bias=False))
    w, ws, xs, _ = fp8_layer()
    # swap_in_fp8 itself swaps wherever it is asked; the loader (deploy/simulate.use_native_fp8) asks only
    # where native_fp8_reason is None, so a CPU target keeps its nn.Linear
    assert swap_in_fp8(lin, {"0.weight": w, "0.weight_scale": ws, "0.input_scale": xs}) == ["0"]
    assert isinstance(lin[0], FP8Linear)
    assert swap_in_fp8(nn.Sequential(nn.Linear(120, 64)), {"0.weight": w[:, :120]}) == []  # no scales: kept


@pytest.mark.gpu
def test_fp8_linear_matches_the_dequantized_product():
    if why := native_fp8_reason("cuda"):
        pytest.skip(why)
    w, ws, xs, x = fp8_layer()
    ref = x.double() @ F.fp8_dequantize(w, ws, torch.float64).t()  # [5, 3, 64]
    bound = 2.0**-4 * (x.abs().double() @ F.fp8_dequantize(w, ws, torch.float64).abs().t()) + 2.0**-8 * ref.abs()
    lin = FP8Linear(w.cuda(), ws.cuda(), xs.cuda())
    y = lin(x.cuda().bfloat16()).double().cpu()
    assert y.shape == ref.shape and bool(((y - ref).abs() <= bound + 1e-6).all())
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight.element_size() == 1  # 1 byte per weight on GPU
