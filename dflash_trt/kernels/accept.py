"""accept: verification of a drafted block on the GPU (greedy and rejection sampling).

Boundary: two Triton kernels + launchers, one program per row. They must equal, value for
value, the project's reference dflash_trt.decoding.verify.greedy_accept / rejection_accept
(read that module for the vocabulary: block = [x0, d1..d_{B-1}], accepted, bonus).

greedy:    draft [R, B], target argmax [R, B] (or logits [R, B, V]: argmax taken in-kernel,
           first index on ties like torch.argmax) -> accepted [R] = leading i in 0..B-2 with
           draft[r, i+1] == argmax[r, i]; bonus [R] = argmax[r, accepted].
rejection: draft [R, B], p [R, B, V], q [R, B-1, V], u_accept [R, B-1], u_sample [R]:
           draft i+1 is accepted iff u_accept[i] * q[i, d] < p[i, d]; the bonus is the inverse
           CDF of normalize(max(p[acc] - q[acc], 0)) at u_sample (p[B-1] when all accepted, p[acc]
           when the residual mass is 0): index = #(cdf <= u * cdf[-1]), clamped to V-1.
The vocabulary is streamed in BLOCK_V tiles, so V may be large (e.g. 152k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_trt.kernels.launching import check_device, interpreting, next_pow2
from dflash_trt.kernels.reference import Verdict


@triton.jit
def greedy_accept_kernel(
    draft_ptr,  # [R, B] int  block tokens (column 0 = last verified token)
    t_ptr,  # [R, B] int target argmax, or [R, B, V] logits when FROM_LOGITS
    B,
    V,
    acc_ptr,
    bonus_ptr,  # [R] int  outputs
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_B)
    imask = i < B
    if FROM_LOGITS:
        best = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
        am = tl.zeros([BLOCK_B], dtype=tl.int32)
        c = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            cmask = (v0 + c) < V
            x = tl.load(
                t_ptr + (r * B + i)[:, None] * V + (v0 + c)[None, :],
                mask=imask[:, None] & cmask[None, :],
                other=float("-inf"),
            ).to(
                tl.float32
            )  # [BB, BV]
            tmax = tl.max(x, axis=1)
            targ = tl.min(tl.where(x == tmax[:, None], (v0 + c)[None, :], 2147483647), axis=1)  # first max
            upd = tmax > best  # strict: earlier tiles win ties
            am = tl.where(upd, targ, am)
            best = tl.where(upd, tmax, best)
    else:
        am = tl.load(t_ptr + r * B + i, mask=imask, other=-1)
    nxt = tl.load(draft_ptr + r * B + i + 1, mask=(i + 1) < B, other=0)  # d_{i+1}
    miss = (i < B - 1) & (nxt != am)
    acc = tl.min(tl.where(miss, i, B - 1), axis=0)
    bonus = tl.sum(tl.where(i == acc, am, 0), axis=0)
    tl.store(acc_ptr + r, acc.to(acc_ptr.dtype.element_ty))
    tl.store(bonus_ptr + r, bonus.to(bonus_ptr.dtype.element_ty))


@triton.jit
def rejection_accept_kernel(
    draft_ptr,  # [R, B] int
    p_ptr,  # [R, B, V] target probabilities
    q_ptr,  # [R, B-1, V] drafter probabilities
    ua_ptr,  # [R, B-1] uniforms for the accept tests
    us_ptr,  # [R] uniform for the residual / bonus sample
    B,
    V,
    acc_ptr,
    bonus_ptr,  # [R] int  outputs
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_B)
    dmask = i < B - 1
    tok = tl.load(draft_ptr + r * B + i + 1, mask=dmask, other=0).to(tl.int64)  # d_{i+1}
    p_d = tl.load(p_ptr + (r * B + i) * V + tok, mask=dmask, other=0.0).to(tl.float32)
    q_d = tl.load(q_ptr + (r * (B - 1) + i) * V + tok, mask=dmask, other=0.0).to(tl.float32)
    u = tl.load(ua_ptr + r * (B - 1) + i, mask=dmask, other=0.0).to(tl.float32)
    reject = dmask & ~(u * q_d < p_d)
    acc = tl.min(tl.where(reject, i, B - 1), axis=0)

    # distribution at slot acc: residual max(p - q, 0) (q = 0 past the last draft)
    q_len = tl.where(acc < B - 1, V, 0)  # q row length: 0 when every draft was accepted
    p_row = p_ptr + (r * B + acc) * V
    q_row = q_ptr + (r * (B - 1) + acc) * V
    c = tl.arange(0, BLOCK_V)
    mass = 0.0
    for v0 in range(0, V, BLOCK_V):  # pass 1: residual mass
        cmask = (v0 + c) < V
        pv = tl.load(p_row + v0 + c, mask=cmask, other=0.0).to(tl.float32)
        qv = tl.load(q_row + v0 + c, mask=(v0 + c) < q_len, other=0.0).to(tl.float32)
        mass += tl.sum(tl.maximum(pv - qv, 0.0), axis=0)
    use_res = mass > 0
    denom = tl.maximum(mass, 1e-30)
    total = 0.0
    for v0 in range(0, V, BLOCK_V):  # pass 2: cdf[-1] of the normalised distribution
        cmask = (v0 + c) < V
        pv = tl.load(p_row + v0 + c, mask=cmask, other=0.0).to(tl.float32)
        qv = tl.load(q_row + v0 + c, mask=(v0 + c) < q_len, other=0.0).to(tl.float32)
        total += tl.sum(tl.where(use_res, tl.maximum(pv - qv, 0.0) / denom, pv), axis=0)
    target = tl.load(us_ptr + r).to(tl.float32) * total
    carry = 0.0
    count = 0
    for v0 in range(0, V, BLOCK_V):  # pass 3: searchsorted(cdf, target, right=True)
        cmask = (v0 + c) < V
        pv = tl.load(p_row + v0 + c, mask=cmask, other=0.0).to(tl.float32)
        qv = tl.load(q_row + v0 + c, mask=(v0 + c) < q_len, other=0.0).to(tl.float32)
        dist = tl.where(use_res, tl.maximum(pv - qv, 0.0) / denom, pv)
        cdf = carry + tl.cumsum(dist, axis=0)
        count += tl.sum(((cdf <= target) & cmask).to(tl.int32), axis=0)
        carry = tl.max(tl.where(cmask, cdf, 0.0), axis=0)
    bonus = tl.minimum(count, V - 1)
    tl.store(acc_ptr + r, acc.to(acc_ptr.dtype.element_ty))
    tl.store(bonus_ptr + r, bonus.to(bonus_ptr.dtype.element_ty))


def _block_v(V: int, block_v: int | None) -> int:
    return block_v or min(64 if interpreting() else 1024, next_pow2(V, 16))


def greedy_accept(
    draft: torch.Tensor, target: torch.Tensor, *, block_v: int | None = None, num_warps: int = 4
) -> Verdict:
    """draft [R, B]; target = argmax [R, B] (int) or logits [R, B, V] (float) -> Verdict (int64 [R])."""
    R, B = draft.shape
    from_logits = target.is_floating_point()
    if target.shape[:2] != (R, B) or target.dim() != (3 if from_logits else 2):
        raise ValueError(f"draft {tuple(draft.shape)} and target {tuple(target.shape)} differ")
    check_device(draft, target)
    V = target.shape[2] if from_logits else 1
    accepted = torch.empty(R, dtype=torch.int64, device=draft.device)
    bonus = torch.empty_like(accepted)
    if R:
        greedy_accept_kernel[(R,)](
            draft.contiguous(),
            target.contiguous(),
            B,
            V,
            accepted,
            bonus,
            BLOCK_B=next_pow2(B, 2),
            BLOCK_V=_block_v(V, block_v) if from_logits else 16,
            FROM_LOGITS=from_logits,
            num_warps=num_warps,
        )
    return Verdict(accepted=accepted, bonus=bonus)


def rejection_accept(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
) -> Verdict:
    """Lossless speculative sampling; shapes as dflash_trt.decoding.verify.rejection_accept."""
    R, B = draft.shape
    V = p.shape[-1]
    if p.shape != (R, B, V) or q.shape != (R, B - 1, V) or u_accept.shape != (R, B - 1) or u_sample.shape != (R,):
        raise ValueError(
            f"shapes: draft {tuple(draft.shape)} p {tuple(p.shape)} q {tuple(q.shape)} "
            f"u_accept {tuple(u_accept.shape)} u_sample {tuple(u_sample.shape)}"
        )
    check_device(draft, p, q, u_accept, u_sample)
    accepted = torch.empty(R, dtype=torch.int64, device=draft.device)
    bonus = torch.empty_like(accepted)
    if R:
        rejection_accept_kernel[(R,)](
            draft.contiguous(),
            p.contiguous(),
            q.contiguous(),
            u_accept.contiguous(),
            u_sample.contiguous(),
            B,
            V,
            accepted,
            bonus,
            BLOCK_B=next_pow2(B, 2),
            BLOCK_V=_block_v(V, block_v),
            num_warps=num_warps,
        )
    return Verdict(accepted=accepted, bonus=bonus)
