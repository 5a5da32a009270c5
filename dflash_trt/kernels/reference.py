"""Plain-PyTorch references for the DFlash drafter kernels (what the Triton kernels must equal).

Boundary: pure tensor in, tensor out; no Triton, no CUDA. These functions define the kernels'
semantics and are what tests/test_kernels.py compares every launcher against. They are
written for clarity (per-row loops), not speed.

Conventions shared with the kernels (see dflash_trt/modeling/drafter.py for the model side):
  caches, contiguous: k_cache/v_cache [R, H_kv, S_max, D] per layer; slot == absolute position.
  caches, paged:      pool [num_pages, H_kv, page_size, D] + block_table [R, max_pages] int32;
                      position p of row r -> page block_table[r, p // page_size], offset p % page_size.
  fp8 caches:         float8_e4m3fn storing x / scale saturated to +-448 (round to nearest even);
                      kv_scale = (k_scale, v_scale) fp32, dequantised as stored * scale.
  k_norm:             x * rsqrt(mean(x^2) + eps) * w in fp32 over head_dim.
  RoPE:               Hugging Face rotate_half, emb = cat(freqs, freqs), freqs = pos * inv_freq.
  GQA:                query head h reads kv head h // (H // H_kv); softmax scale D ** -0.5.
The accept kernels' references are dflash_trt.decoding.verify.greedy_accept / rejection_accept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass
class Verdict:
    """What verification returns (the accept kernels and decoding/verify.py alike); here, at the bottom of
    the package graph, so that kernels/ need not import decoding/."""

    accepted: torch.Tensor  # [R] int64, drafts kept per row (0..B-1)
    bonus: torch.Tensor  # [R] int64, the target's extra token per row


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """inv_freq [D/2] fp32 = 1 / theta^(arange(0, D, 2) / D) (Hugging Face default rope)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def _scales(kv_scale) -> tuple[float, float]:
    if kv_scale is None:
        return 1.0, 1.0
    s = torch.as_tensor(kv_scale, dtype=torch.float32).flatten().tolist()
    return (s[0], s[0]) if len(s) == 1 else (s[0], s[1])


def _encode(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp32 values -> cache storage dtype (fp8 stores x / scale)."""
    return (x / scale).clamp(-448.0, 448.0).to(dtype) if dtype == FP8 else x.to(dtype)


def _decode(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale if x.dtype == FP8 else x.float()


def kv_project_ref(
    h: torch.Tensor,
    positions: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    k_norm_w: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    rope_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's context K/V in fp32.

    h [n, d], positions [n], wk/wv [H_kv*D, d], k_norm_w [D], inv_freq [D/2] -> k, v [H_kv, n, D].
    """
    D = k_norm_w.shape[-1]
    n = h.shape[0]
    hf = h.float()
    k = (hf @ wk.float().T).view(n, -1, D)  # [n, H_kv, D]
    v = (hf @ wv.float().T).view(n, -1, D)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm_w.float()
    freqs = positions.float()[:, None] * inv_freq.float()  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [n, 1, D]
    cos, sin = emb.cos() * rope_scale, emb.sin() * rope_scale
    rot = torch.cat((-k[..., D // 2 :], k[..., : D // 2]), dim=-1)
    k = k * cos + rot * sin
    return k.transpose(0, 1), v.transpose(0, 1)


def kv_inject_ref(
    h,
    positions,
    n_new,
    wk,
    wv,
    k_norm_w,
    inv_freq,
    k_cache,
    v_cache,
    *,
    eps: float = 1e-6,
    block_table=None,
    kv_scale=None,
    rope_scale: float = 1.0,
):
    """Write every layer's context K/V into the caches in place; returns (k_cache, v_cache).

    h [R, n, d]; positions [R, n]; n_new [R] (first n_new[r] tokens of row r are valid);
    wk/wv [L, H_kv*D, d]; k_norm_w [L, D]; inv_freq [D/2];
    k_cache/v_cache [L, R, H_kv, S_max, D] or, with block_table [R, max_pages],
    pools [L, num_pages, H_kv, page_size, D].
    """
    ks, vs = _scales(kv_scale)
    for r in range(h.shape[0]):
        nv = int(n_new[r])
        if nv == 0:
            continue
        pos = positions[r, :nv].long()
        for layer in range(wk.shape[0]):
            k, v = kv_project_ref(h[r, :nv], pos, wk[layer], wv[layer], k_norm_w[layer], inv_freq, eps, rope_scale)
            if block_table is None:
                k_cache[layer, r, :, pos] = _encode(k, k_cache.dtype, ks)
                v_cache[layer, r, :, pos] = _encode(v, v_cache.dtype, vs)
            else:
                ps = k_cache.shape[3]
                page, off = block_table[r, pos // ps].long(), pos % ps
                k_cache[layer, page, :, off] = _encode(k, k_cache.dtype, ks).transpose(0, 1)
                v_cache[layer, page, :, off] = _encode(v, v_cache.dtype, vs).transpose(0, 1)
    return k_cache, v_cache


def gather_context(cache: torch.Tensor, r: int, length: int, block_table=None) -> torch.Tensor:
    """Row r's first `length` cache slots of one layer -> [H_kv, length, D] (storage dtype)."""
    if block_table is None:
        return cache[r, :, :length]
    pos = torch.arange(length, device=cache.device)
    ps = cache.shape[2]
    return cache[block_table[r, pos // ps].long(), :, pos % ps].transpose(0, 1)


def block_draft_attention_ref(
    q, k_blk, v_blk, k_cache, v_cache, ctx_len, *, block_table=None, kv_scale=None
) -> torch.Tensor:
    """Non-causal block attention over [row's context ; the block's own K/V].

    q [R, H, B, D]; k_blk/v_blk [R, H_kv, B, D]; caches [R, H_kv, S_max, D] (or pools
    [num_pages, H_kv, page_size, D] with block_table [R, max_pages]); ctx_len [R] -> [R, H, B, D].
    """
    R, H, B, D = q.shape
    ks, vs = _scales(kv_scale)
    out = torch.empty_like(q)
    for r in range(R):
        c = int(ctx_len[r])
        k = torch.cat([_decode(gather_context(k_cache, r, c, block_table), ks), k_blk[r].float()], dim=1)
        v = torch.cat([_decode(gather_context(v_cache, r, c, block_table), vs), v_blk[r].float()], dim=1)
        rep = H // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)  # [H, c+B, D]
        att = (q[r].float() @ k.transpose(1, 2) * D**-0.5).softmax(-1)
        out[r] = (att @ v).to(q.dtype)
    return out
