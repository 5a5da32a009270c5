"""FP8 E4M3 and NVFP4 number formats, as NVIDIA Model Optimizer (modelopt) defines them.

Boundary: pure tensor maths on single tensors: scale computation, rounding to the format, packing,
and the inverse. Nothing here knows about layers, state dicts or files (see quantize.py).

FP8  (torch.float8_e4m3fn, largest finite 448): q = cast(x / s), x ~ q * s, s = amax / 448 (float32),
     one scale per tensor (shape []) or per output channel (shape [out]).
NVFP4: E2M1 values {0, .5, 1, 1.5, 2, 3, 4, 6} (sign-magnitude nibble: bit 3 = sign, bits 0-2 = index
     into that list), blocks of 16 consecutive values along the input (last) dim. Two scales:
       weight_scale_2 = amax(tensor) / (6 * 448)                      float32, shape []
       weight_scale   = fp8(amax(block) / (6 * weight_scale_2))       float8_e4m3fn, [out, in / 16]
     x ~ e2m1 * float(weight_scale) * weight_scale_2. Two values per uint8, element 2j in the low
     nibble and 2j+1 in the high nibble ([out, in] -> [out, in / 2]).
Rounding is round-to-nearest, ties to the even code (as modelopt's NVFP4QTensor._cast_fp4 does).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
FP8_MIN_SUBNORMAL = 2.0**-9  # block scales are clamped here so tiny blocks do not become 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7


def _grid(device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


# ---- FP8 -------------------------------------------------------------------------------------
def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to E4M3 (torch's own cast turns out-of-range values into NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_scale(w: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    """w: [out, in]. Scale amax / 448 as float32: shape [] (per-tensor) or [out] (per-channel).
    All-zero tensors / rows get scale 1 so that they stay exactly zero."""
    a = w.detach().float().abs()
    amax = a.amax(dim=tuple(range(1, w.dim()))) if per_channel else a.amax()
    s = amax / FP8_MAX
    return torch.where(s == 0, torch.ones_like(s), s)


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w: [out, in] float; scale: [] or [out] float32. Returns float8_e4m3fn [out, in]."""
    s = scale.float()
    if s.dim() == 1:
        s = s[:, None]
    return to_fp8(w.float() / s)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: float8_e4m3fn [out, in]; scale: [] or [out]. Returns q * scale in `dtype`."""
    s = scale.float()
    if s.dim() == 1:
        s = s[:, None]
    return (q.float() * s).to(dtype)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Simulated FP8 round trip x -> fp8(x / scale) * scale, in x's dtype (e.g. an FP8 KV cache
    with scale kv_cache_scaling_factor). scale: python float or a tensor broadcastable to x."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (to_fp8(x.float() / s).float() * s).to(x.dtype)


def fp8_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the distance between neighbouring E4M3 values around |y| (y in units of the scale):
    ulp = 2^(e - 3) for normal |y| >= 2^-6 (e = floor(log2 |y|)), 2^-9 for subnormals."""
    a = y.abs().float().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3) / 2


# ---- E2M1 ------------------------------------------------------------------------------------
def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """y: float tensor already divided by its scale. Returns uint8 codes 0..15 (sign << 3 | index)
    of the nearest E2M1 value (|y| > 6 saturates to 6; ties go to the even index)."""
    grid = _grid(y.device)
    a = y.float().abs()
    hi = torch.bucketize(a, grid).clamp(max=len(grid) - 1)  # first grid point >= a
    lo = (hi - 1).clamp(min=0)
    d_hi, d_lo = grid[hi] - a, a - grid[lo]
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = torch.where(take_hi, hi, lo).to(torch.uint8)
    return idx | ((y < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values (code 8 is -0 and decodes to 0)."""
    c = codes.long()
    mag = _grid(codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [..., n] (n even) -> uint8 [..., n / 2]; element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} must be even")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> codes uint8 [..., 2m] (inverse of pack_e2m1)."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def e2m1_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the spacing of E2M1 values around |y| (units of the block scale): .25 below 2, .5 in
    [2, 4), 1 in [4, 6]."""
    a = y.abs().float()
    return torch.where(a < 2, torch.full_like(a, 0.25), torch.where(a < 4, torch.full_like(a, 0.5), torch.ones_like(a)))


# ---- NVFP4 -----------------------------------------------------------------------------------
def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 = amax / (6 * 448) as float32 shape [] (1 for an all-zero tensor)."""
    s = w.detach().float().abs().amax() / (E2M1_MAX * FP8_MAX)
    return torch.where(s == 0, torch.ones_like(s), s)


def _check_blocks(w: torch.Tensor, what: str = "tensor") -> None:
    if w.dim() != 2 or w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs a 2-D {what} whose input dim is a multiple of {NVFP4_BLOCK}; "
            f"got shape {tuple(w.shape)} (exclude this layer from quantization)"
        )


def nvfp4_block_scale(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """w: [out, in]; global_scale: []. Per-block scale as float8_e4m3fn [out, in / 16]."""
    _check_blocks(w)
    amax = w.detach().float().abs().unflatten(-1, (-1, NVFP4_BLOCK)).amax(-1)
    s = amax / (E2M1_MAX * global_scale.float())
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s.clamp(min=FP8_MIN_SUBNORMAL, max=FP8_MAX).to(FP8_DTYPE)


def nvfp4_quantize(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, block_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] float (in % 16 == 0). Returns (packed uint8 [out, in/2], weight_scale fp8
    [out, in/16], weight_scale_2 float32 []). Pass global_scale to share it across fused layers."""
    _check_blocks(w)
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.float().reshape(())
    bs = nvfp4_block_scale(w, gs) if block_scale is None else block_scale
    eff = bs.float() * gs  # [out, in/16]
    y = w.float().unflatten(-1, (-1, NVFP4_BLOCK)) / eff[..., None]
    return pack_e2m1(e2m1_encode(y.flatten(-2))), bs, gs


def nvfp4_dequantize(
    packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed: uint8 [out, in/2]; weight_scale: fp8 [out, in/16]; weight_scale_2: []. -> [out, in]."""
    vals = e2m1_decode(unpack_e2m1(packed)).unflatten(-1, (-1, NVFP4_BLOCK))
    eff = weight_scale.float() * weight_scale_2.float().reshape(())
    return (vals * eff[..., None]).flatten(-2).to(dtype)


def input_scale_from_amax(amax: float | torch.Tensor, algo: str) -> torch.Tensor:
    """Static activation scale (float32 []) from a calibrated input amax: amax / 448 for FP8,
    amax / (6 * 448) for NVFP4 (modelopt's get_activation_scaling_factor)."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    a = torch.where(a > 0, a, torch.ones_like(a))
    return a / (FP8_MAX * (E2M1_MAX if algo == "NVFP4" else 1.0))
