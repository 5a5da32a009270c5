"""kv_inject: context features -> K/V of every drafter layer, written into the KV caches.

Boundary: one Triton kernel + its launcher (module named inject.py so that the package attribute
dflash_trt.kernels.kv_inject stays the launcher). Input is the fused context feature h (after fc and
hidden_norm) of the newly verified tokens; output is in-place writes to the caches of ALL L
layers in one launch (no per-layer Python loop). Semantics are defined by
reference.kv_inject_ref; see reference.py for the cache layouts and math conventions.

Per program: one tile of BLOCK_T tokens of one row, for one (layer, kv head). It computes
  K = RoPE(k_norm(h @ Wk[l, head]^T)), V = h @ Wv[l, head]^T     fp32 accumulation
with K split in halves [.., :D/2] / [.., D/2:] so rotate_half is plain arithmetic, then stores
only the valid tokens (t < n_new[r]) at their positions (contiguous or paged), optionally as
fp8 e4m3 (x / scale, saturated to +-448, round-to-nearest-even).
Grid: (cdiv(n, BLOCK_T), R, L * H_kv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_trt.kernels.launching import (
    FP8,
    cdiv,
    check_device,
    dummy_i32,
    int32,
    interpreting,
    need_contiguous,
    next_pow2,
    scale_tensor,
)


@triton.jit
def kv_inject_kernel(
    h_ptr,  # [R, N, DM]  context features (bf16/fp16/fp32)
    pos_ptr,  # [R, N] int32  absolute positions
    nnew_ptr,  # [R] int32  valid tokens per row (a prefix of the N)
    wk_ptr,  # [L, HKV*D, DM]  k_proj weights, nn.Linear layout
    wv_ptr,  # [L, HKV*D, DM]  v_proj weights
    knw_ptr,  # [L, D]  k_norm weights
    invf_ptr,  # [D/2] fp32  rope inverse frequencies
    bt_ptr,  # [R, MAXP] int32  block table (read only when PAGED)
    scale_ptr,  # [2] fp32  (k_scale, v_scale) (read only when FP8)
    kin_ptr,
    vin_ptr,  # caches as inputs (TensorRT aliases them to the outputs; unused here)
    N,
    DM,
    HKV,  # tokens per row, feature width, kv heads
    NSEQ,
    S,
    MAXP,  # contiguous: R, S_max, -   paged: num_pages, page_size, max_pages
    kout_ptr,
    vout_ptr,  # [L, NSEQ, HKV, S, D]  caches written in place
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPS: tl.constexpr,
    ROPE_SCALE: tl.constexpr,
    PAGED: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    r = tl.program_id(1)
    l = tl.program_id(2) // HKV  # noqa: E741 (layer index, as in the launcher's grid)
    hk = tl.program_id(2) % HKV
    n_valid = tl.minimum(tl.load(nnew_ptr + r), N)
    if tl.program_id(0) * BLOCK_T >= n_valid:  # ragged rows: nothing valid in this tile
        return
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token index in the row
    tmask = t < n_valid
    row_tok = r.to(tl.int64) * N + t  # [BT]
    pos = tl.load(pos_ptr + row_tok, mask=tmask, other=0)
    j = tl.arange(0, HALF)  # [HALF] column within a half head
    kk = tl.arange(0, BLOCK_K)
    # rows hk*D + j of layer l's weight matrix, as element offsets [HALF, 1]
    w_row = ((l.to(tl.int64) * HKV + hk) * D + j)[:, None] * DM

    k1 = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)  # K[:, :D/2]
    k2 = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)  # K[:, D/2:]
    v1 = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)
    v2 = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)
    for k0 in range(0, DM, BLOCK_K):
        kmask = (k0 + kk) < DM
        x = tl.load(
            h_ptr + row_tok[:, None] * DM + (k0 + kk)[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0
        )  # [BT, BK]
        w_off = w_row + (k0 + kk)[None, :]  # [HALF, BK]
        wmask = kmask[None, :]
        wk1 = tl.load(wk_ptr + w_off, mask=wmask, other=0.0)
        wk2 = tl.load(wk_ptr + w_off + HALF * DM, mask=wmask, other=0.0)
        wv1 = tl.load(wv_ptr + w_off, mask=wmask, other=0.0)
        wv2 = tl.load(wv_ptr + w_off + HALF * DM, mask=wmask, other=0.0)
        if INTERPRET:  # the CPU interpreter cannot dot 16-bit floats; values are exact in fp32
            x = x.to(tl.float32)
            wk1, wk2, wv1, wv2 = wk1.to(tl.float32), wk2.to(tl.float32), wv1.to(tl.float32), wv2.to(tl.float32)
        k1 = tl.dot(x, tl.trans(wk1), k1, input_precision="ieee")
        k2 = tl.dot(x, tl.trans(wk2), k2, input_precision="ieee")
        v1 = tl.dot(x, tl.trans(wv1), v1, input_precision="ieee")
        v2 = tl.dot(x, tl.trans(wv2), v2, input_precision="ieee")

    # k_norm: RMSNorm over the full head (both halves), fp32
    rinv = tl.rsqrt((tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / D + EPS)[:, None]
    nw1 = tl.load(knw_ptr + l * D + j).to(tl.float32)[None, :]
    nw2 = tl.load(knw_ptr + l * D + HALF + j).to(tl.float32)[None, :]
    k1 = k1 * rinv * nw1
    k2 = k2 * rinv * nw2
    # RoPE, rotate_half convention: [k1, k2] -> [k1 cos - k2 sin, k2 cos + k1 sin]
    freqs = pos.to(tl.float32)[:, None] * tl.load(invf_ptr + j)[None, :]  # [BT, HALF]
    cos = tl.cos(freqs) * ROPE_SCALE
    sin = tl.sin(freqs) * ROPE_SCALE
    r1 = k1 * cos - k2 * sin
    r2 = k2 * cos + k1 * sin

    if PAGED:
        seq = tl.load(bt_ptr + r.to(tl.int64) * MAXP + pos // S, mask=tmask, other=0).to(tl.int64)
        slot = pos % S
    else:
        seq = r.to(tl.int64) + tl.zeros([BLOCK_T], dtype=tl.int64)
        slot = pos
    base = (((l.to(tl.int64) * NSEQ + seq) * HKV + hk) * S + slot)[:, None] * D + j[None, :]  # [BT, HALF]
    smask = tmask[:, None]
    if FP8:
        ks = tl.load(scale_ptr)
        vs = tl.load(scale_ptr + 1)
        r1 = tl.clamp(r1 / ks, -448.0, 448.0)
        r2 = tl.clamp(r2 / ks, -448.0, 448.0)
        v1 = tl.clamp(v1 / vs, -448.0, 448.0)
        v2 = tl.clamp(v2 / vs, -448.0, 448.0)
        # round to e4m3's 3 mantissa bits (nearest-even) in fp32 first: the cast below is then
        # exact on every backend (the CPU interpreter's own fp8 rounding is not RNE)
        b = r1.to(tl.int32, bitcast=True)
        r1 = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        b = r2.to(tl.int32, bitcast=True)
        r2 = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        b = v1.to(tl.int32, bitcast=True)
        v1 = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        b = v2.to(tl.int32, bitcast=True)
        v2 = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    out_ty = kout_ptr.dtype.element_ty
    tl.store(kout_ptr + base, r1.to(out_ty), mask=smask)
    tl.store(kout_ptr + base + HALF, r2.to(out_ty), mask=smask)
    tl.store(vout_ptr + base, v1.to(out_ty), mask=smask)
    tl.store(vout_ptr + base + HALF, v2.to(out_ty), mask=smask)


def kv_inject(
    h: torch.Tensor,
    positions: torch.Tensor,
    n_new: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    k_norm_w: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    eps: float = 1e-6,
    block_table: torch.Tensor | None = None,
    kv_scale=None,
    rope_scale: float = 1.0,
    block_t: int = 16,
    block_k: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write K/V of all L layers for the valid context tokens; returns (k_cache, v_cache).

    h [R, n, d]; positions [R, n]; n_new [R] (<= n); wk/wv [L, H_kv*D, d]; k_norm_w [L, D];
    inv_freq [D/2] fp32; k_cache/v_cache [L, R, H_kv, S_max, D] (contiguous) or, with
    block_table [R, max_pages] int32, pools [L, num_pages, H_kv, page_size, D]. Positions of valid
    tokens must lie inside the cache (< S_max, or covered by the row's block_table): not checked.
    Caches may be bf16/fp16/fp32 or float8_e4m3fn (then kv_scale = k_scale or (k_scale, v_scale)).
    """
    R, N, DM = h.shape
    L, HD, _ = wk.shape
    D = k_norm_w.shape[-1]
    HKV = HD // D
    dev = check_device(h, positions, n_new, wk, wv, k_norm_w, inv_freq, k_cache, v_cache)
    if HKV * D != HD or wv.shape != wk.shape or wk.shape[2] != DM or D < 32 or D & (D - 1):
        raise ValueError(
            f"bad shapes: wk {tuple(wk.shape)}, wv {tuple(wv.shape)}, h {tuple(h.shape)}, "
            f"head_dim {D} (a power of two >= 32)"
        )
    if (
        k_cache.shape != v_cache.shape
        or k_cache.dtype != v_cache.dtype
        or k_cache.shape[-1] != D
        or k_cache.shape[0] != L
        or k_cache.shape[2] != HKV
    ):
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match L={L}, H_kv={HKV}, D={D}")
    if wk.dtype != h.dtype or wv.dtype != h.dtype:
        raise ValueError(f"h {h.dtype} and weights {wk.dtype}/{wv.dtype} must share a dtype")
    need_contiguous("k_cache", k_cache)
    need_contiguous("v_cache", v_cache)
    paged = block_table is not None
    if not paged and k_cache.shape[1] != R:
        raise ValueError(f"contiguous cache has {k_cache.shape[1]} rows, h has {R}")
    if R == 0 or N == 0:
        return k_cache, v_cache
    bt = int32(block_table) if paged else dummy_i32(dev)
    block_k = block_k or min(64, next_pow2(DM))
    grid = (cdiv(N, block_t), R, L * HKV)
    kv_inject_kernel[grid](
        h.contiguous(),
        int32(positions),
        int32(n_new),
        wk.contiguous(),
        wv.contiguous(),
        k_norm_w.contiguous(),
        inv_freq.float().contiguous(),
        bt,
        scale_tensor(kv_scale, dev),
        k_cache,
        v_cache,
        N,
        DM,
        HKV,
        k_cache.shape[1],
        k_cache.shape[3],
        bt.shape[-1] if paged else 1,
        k_cache,
        v_cache,
        D=D,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        EPS=float(eps),
        ROPE_SCALE=float(rope_scale),
        PAGED=paged,
        FP8=k_cache.dtype == FP8,
        INTERPRET=interpreting(),
        num_warps=num_warps,
    )
    return k_cache, v_cache
