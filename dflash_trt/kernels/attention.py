"""block_draft_attention: the drafter block's queries against [row context ; the block itself].

Boundary: one Triton kernel + its launcher; semantics are reference.block_draft_attention_ref.
Inputs are already projected, q_norm'ed/k_norm'ed and RoPE'd: q [R, H, B, D] and the block's
own k/v [R, H_kv, B, D]; the context K/V come from one layer's cache (contiguous
[R, H_kv, S_max, D], or paged pools [num_pages, H_kv, page_size, D] + block_table), of which
row r uses slots 0..ctx_len[r]-1 (ctx_len may be 0). Attention is NON-causal.

Flash-style: a program owns BLOCK_M query rows of one (row, kv head) -- the G = H / H_kv query
heads sharing that kv head are stacked as G*B rows, so each K/V tile is loaded once for the
whole GQA group -- and streams context tiles of BLOCK_N slots, then the block tile, through an
online softmax (running max m, normaliser l, fp32 accumulator). Memory per program is
O(BLOCK_M x D) whatever the context length. Grid: (cdiv(G*B, BLOCK_M), H_kv, R).
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
def block_attention_kernel(
    q_ptr,  # [R, H, B, D]
    kb_ptr,
    vb_ptr,  # [R, HKV, B, D]  the block's own K/V
    kc_ptr,
    vc_ptr,  # [(L,) NSEQ, HKV, S, D]  context cache (contiguous: NSEQ=R; paged: pages)
    ctx_ptr,  # [R] int32  context length per row
    bt_ptr,  # [R, MAXP] int32  block table (read only when PAGED)
    scale_ptr,  # [2] fp32  (k_scale, v_scale) (read only when FP8)
    H,
    HKV,
    B,
    NSEQ,
    S,
    MAXP,
    LAYER,  # LAYER: index into a stacked [L, ...] cache (0 if per-layer)
    o_ptr,  # [R, H, B, D]
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SM_SCALE: tl.constexpr,
    PAGED: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    hk = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    G = H // HKV
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row in the (g, i) stack
    mmask = m < G * B
    q_off = ((r * H + hk * G + m // B) * B + m % B) * D  # [BM]
    d = tl.arange(0, D)
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=mmask[:, None], other=0.0)  # [BM, D]
    if INTERPRET:  # the CPU interpreter cannot dot 16-bit floats
        q = q.to(tl.float32)
    qk_scale = SM_SCALE * 1.4426950408889634  # softmax in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if FP8:
        ks = tl.load(scale_ptr)
        vs = tl.load(scale_ptr + 1)

    # ---- context tiles: slots [start, start + BLOCK_N) of this row, masked at ctx_len ----
    ctx = tl.load(ctx_ptr + r)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, ctx, BLOCK_N):
        p = start + n  # [BN] absolute positions
        nmask = p < ctx
        if PAGED:
            seq = tl.load(bt_ptr + r * MAXP + p // S, mask=nmask, other=0).to(tl.int64)
            slot = p % S
        else:
            seq = r + tl.zeros([BLOCK_N], dtype=tl.int64)
            slot = p
        seq += LAYER * NSEQ  # int32 row count, promoted to int64
        kv_off = (((seq * HKV + hk) * S + slot) * D)[:, None] + d[None, :]  # [BN, D]
        k = tl.load(kc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        if FP8:
            k = (k.to(tl.float32) * ks).to(q.dtype)
            v = (v.to(tl.float32) * vs).to(q.dtype)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BM, BN]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # ---- the block's own B keys (always >= 1 valid, so l_i > 0 afterwards) ----
    b = tl.arange(0, BLOCK_B)
    bmask = b < B
    kb_off = (((r * HKV + hk) * B + b) * D)[:, None] + d[None, :]  # [BB, D]
    k = tl.load(kb_ptr + kb_off, mask=bmask[:, None], other=0.0)
    v = tl.load(vb_ptr + kb_off, mask=bmask[:, None], other=0.0)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BM, BB]
    s = tl.where(bmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")

    out = acc / l_i[:, None]
    tl.store(o_ptr + q_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


def block_draft_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_len: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    kv_scale=None,
    layer: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Block queries attend to their row's cached context and the block's own K/V; -> [R, H, B, D].

    q [R, H, B, D]; k_blk/v_blk [R, H_kv, B, D] (same dtype as q); k_cache/v_cache
    [R, H_kv, S_max, D] or, with block_table [R, max_pages] int32, [num_pages, H_kv, page_size, D];
    or the same with a leading layer axis [L, ...], read at `layer` (no slicing copy);
    caches may be float8_e4m3fn (dequantised with kv_scale = k_scale or (k_scale, v_scale));
    ctx_len [R] with 0 <= ctx_len[r] <= S_max (contiguous) / max_pages * page_size (paged): not
    checked (that would need a device sync).
    """
    R, H, B, D = q.shape
    HKV = k_blk.shape[1]
    dev = check_device(q, k_blk, v_blk, k_cache, v_cache, ctx_len)
    if k_blk.shape != (R, HKV, B, D) or v_blk.shape != k_blk.shape or H % HKV:
        raise ValueError(f"q {tuple(q.shape)} / k_blk {tuple(k_blk.shape)} / v_blk {tuple(v_blk.shape)} mismatch")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two >= 16")
    stacked = k_cache.dim() == 5
    if stacked and not 0 <= layer < k_cache.shape[0]:
        raise ValueError(f"layer {layer} out of range for {k_cache.shape[0]} cached layers")
    shp = k_cache.shape[1:] if stacked else k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() not in (4, 5) or shp[1] != HKV or shp[3] != D:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match H_kv={HKV}, D={D}")
    need_contiguous("k_cache", k_cache)
    need_contiguous("v_cache", v_cache)
    paged = block_table is not None
    if not paged and shp[0] != R:
        raise ValueError(f"contiguous cache has {shp[0]} rows, q has {R}")
    q = q.contiguous()  # the kernel writes out with q's contiguous strides (empty_like keeps a view's strides)
    out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    bt = int32(block_table) if paged else dummy_i32(dev)
    G = H // HKV
    block_m = block_m or min(64, next_pow2(G * B))
    block_n = block_n or (16 if interpreting() else 64)
    grid = (cdiv(G * B, block_m), HKV, R)
    block_attention_kernel[grid](
        q,
        k_blk.contiguous(),
        v_blk.contiguous(),
        k_cache,
        v_cache,
        int32(ctx_len),
        bt,
        scale_tensor(kv_scale, dev),
        H,
        HKV,
        B,
        shp[0],
        shp[2],
        bt.shape[-1] if paged else 1,
        layer if stacked else 0,
        out,
        D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_B=next_pow2(B),
        SM_SCALE=D**-0.5,
        PAGED=paged,
        FP8=k_cache.dtype == FP8,
        INTERPRET=interpreting(),
        num_warps=num_warps,
    )
    return out
