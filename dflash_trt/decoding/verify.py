"""Verification: which drafted tokens the target accepts. Pure tensor in, tensor out.

Vocabulary used throughout (for one row, block size B):
  block   = [x0, d1, ..., d_{B-1}]: x0 is the last verified token, d_i are drafted tokens.
  target  = the target's logits for every block position; logits[i] predicts the token
            that follows block[i], so logits[i] judges d_{i+1}.
  accepted (int in 0..B-1) = how many leading drafts the target keeps: d_1..d_accepted.
  bonus   = one more token, always produced by the target: at the first rejected
            position it is the target's own choice (greedy) or a sample from the
            residual max(p - q, 0) (sampling); if all B-1 drafts pass it comes from
            logits[B-1].
  A verify step therefore emits accepted + 1 tokens: d_1..d_accepted, bonus.

Greedy acceptance keeps the longest prefix with d_{i+1} == argmax(logits[i]) and so emits
exactly the target's greedy continuation. Rejection sampling (Leviathan et al. 2023; Chen
et al. 2023) accepts d with probability min(1, p(d)/q(d)) and resamples from the
normalised residual, so emitted tokens are distributed exactly as the target's p.
The random numbers are arguments so that a GPU kernel can be checked against this code;
accept_rows, the engine's per-row dispatch over a batch of requests, draws them from each
row's generator.
"""

from __future__ import annotations

import torch

from dflash_trt import kernels
from dflash_trt.config import SamplingParams
from dflash_trt.kernels.reference import Verdict
from dflash_trt.modeling.fast_path import resolve


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor) -> Verdict:
    """Greedy verification.

    draft:         [R, B]  block tokens; column 0 is the last verified token.
    target_argmax: [R, B]  argmax of the target logits at every block position.
    """
    if draft.shape != target_argmax.shape:
        raise ValueError(f"draft {tuple(draft.shape)} and target_argmax {tuple(target_argmax.shape)} differ")
    match = (draft[:, 1:] == target_argmax[:, :-1]).long()  # [R, B-1]
    accepted = match.cumprod(dim=1).sum(dim=1)  # [R]
    bonus = target_argmax.gather(1, accepted[:, None]).squeeze(1)
    return Verdict(accepted=accepted, bonus=bonus)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index per row of probs [R, V] (rows sum to 1) with uniforms u [R] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def rejection_accept(
    draft: torch.Tensor,  # [R, B]
    p: torch.Tensor,  # [R, B, V] target probabilities (after temperature / top-k / top-p)
    q: torch.Tensor,  # [R, B-1, V] drafter probabilities that produced draft[:, 1:]
    u_accept: torch.Tensor,  # [R, B-1] uniforms in [0, 1) for the accept tests
    u_sample: torch.Tensor,  # [R] uniform in [0, 1) for the residual / bonus sample
) -> Verdict:
    """Lossless speculative sampling: accept d_{i+1} iff u_accept[i] * q_i(d) < p_i(d)."""
    R, B = draft.shape
    d = draft[:, 1:]  # [R, B-1]
    p_d = p[:, :-1].gather(2, d.unsqueeze(-1)).squeeze(-1)  # [R, B-1]
    q_d = q.gather(2, d.unsqueeze(-1)).squeeze(-1)
    ok = (u_accept * q_d < p_d).long()
    accepted = ok.cumprod(dim=1).sum(dim=1)  # [R]
    rows = torch.arange(R, device=draft.device)
    p_at = p[rows, accepted]  # [R, V] target distribution at the first rejected (or last) slot
    q_pad = torch.cat([q, q.new_zeros(R, 1, q.shape[-1])], dim=1)  # all accepted -> residual is p itself
    residual = (p_at - q_pad[rows, accepted]).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # When p == q at that slot the residual is empty; rejection then had probability 0,
    # but fall back to p to stay well-defined under floating point.
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    bonus = _inverse_cdf(dist, u_sample)
    return Verdict(accepted=accepted, bonus=bonus)


def accept_rows(
    ops,
    block: torch.Tensor,  # [R, W] last token + drafts
    logits: torch.Tensor,  # [R, W, V] target logits (after the rows' logit controls, decoding/penalties.py)
    q: torch.Tensor | None,  # [R, W-1, V] drafter probabilities, None when every row is greedy
    n_draft: torch.Tensor,  # [R] drafts row r judges
    rows: list[tuple[SamplingParams, torch.Generator]],
    variable: bool,
    block_size: int,
) -> Verdict:
    """A round's verdict for a batch of requests. ops: greedy(block, logits) / rejection(...) as
    modeling/fast_path.py's TorchAccept or TritonAccept; variable: rows may judge fewer than W-1
    drafts; a sampled row draws block_size uniforms from its generator whatever W is."""
    W = block.shape[1]
    if q is None:
        if variable:  # drafts past a row's length become -1, never a token: it stops there
            past = torch.arange(1, W, device=block.device) > n_draft[:, None]  # [R, W-1]
            block = torch.cat([block[:, :1], block[:, 1:].masked_fill(past, -1)], dim=1)
        return ops.greedy(block, logits)
    accepted, bonus = [], []
    for r, (params, gen) in enumerate(rows):
        n = int(n_draft[r]) + 1
        if params.greedy:
            v = ops.greedy(block[r : r + 1, :n], logits[r : r + 1, :n])
        else:
            p = warp_logits(logits[r, :n], params)
            u = torch.rand(block_size, generator=gen, device=logits.device)
            v = ops.rejection(block[r : r + 1, :n], p[None], q[r : r + 1, : n - 1], u[None, : n - 1], u[-1:])
        accepted.append(v.accepted)
        bonus.append(v.bonus)
    return Verdict(torch.cat(accepted), torch.cat(bonus))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits [..., V]; returns probabilities.

    Used identically for the target's p and the drafter's q, as the lossless argument needs
    the drafter's sampling distribution to be the q that rejection sampling divides by.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V], drawn with the given generator."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], generator=generator, device=flat.device)
    return _inverse_cdf(flat, u).reshape(probs.shape[:-1])


def two_branch_accept(
    draft: list[int],  # the drafter's drafts d_1..d_nd
    copy: list[int],  # the copied drafts c_1..c_nc (a point mass each); a shared prefix with draft allowed
    p_d: torch.Tensor,  # [nd+1, V] target probabilities along the drafter's branch (x0, d_1, ..)
    p_c: torch.Tensor,  # [nc+1, V] along the copy's branch (the same rows as p_d over the shared prefix)
    q: torch.Tensor,  # [>=nd, V] the drafter's distributions that produced d
    u_d: torch.Tensor,  # [>=nd] uniforms for the drafter's candidates
    u_c: torch.Tensor,  # [>=nc] uniforms for the copy's candidates
    u_s: torch.Tensor,  # [1] uniform for the residual / bonus sample
) -> tuple[int, int, bool]:
    """Lossless speculative sampling over two candidate branches (one row): recursive rejection sampling
    (SpecInfer's multi-step speculative sampling, Miao et al. 2023). At each depth the live candidates are
    tried in a fixed order, the drafter's x ~ q first, then the copy's c: accept x iff u_d * q(x) < p(x);
    else p <- normalised max(p - q, 0) and accept c iff u_c < p(c) (its q is a point mass); else the
    token is sampled from p without c, normalised. Each stage is plain speculative sampling of the current
    p, and the candidates do not depend on the coins (c is fixed by the past, x drawn from q), so every
    emitted token follows the target. Where both branches propose the same token both stay alive; an
    accepted token that is one branch's alone ends the other. -> (accepted, bonus, copy's branch kept):
    the copy's when the drafter's branch ended first, else the drafter's."""
    live_d, live_c, i = True, bool(copy), 0
    while True:
        p = p_d[i] if live_d else p_c[i]
        x = draft[i] if live_d and i < len(draft) else None
        c = copy[i] if live_c and i < len(copy) else None
        if x is not None:
            if float(u_d[i]) * float(q[i, x]) < float(p[x]):
                live_c, i = live_c and c == x, i + 1
                continue
            p = _normalised((p - q[i]).clamp(min=0), p)
        if c is not None:
            if float(u_c[i]) < float(p[c]):
                live_d, i = live_d and x == c, i + 1
                continue
            p = _normalised(p.index_fill(0, torch.tensor([c], device=p.device), 0.0), p)
        return i, int(_inverse_cdf(p[None], u_s)[0]), not live_d  # the residual, or p past both branches


def _normalised(residual: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """residual [V] / its mass; p itself where the mass is 0 (that rejection had probability 0)."""
    mass = residual.sum()
    return residual / mass if float(mass) > 0 else p


# ---- acceptance ---------------------------------------------------------------------------
class TorchAccept:
    """The reference: decoding/verify.py."""

    name = "torch"

    @staticmethod
    def greedy(block: torch.Tensor, logits: torch.Tensor) -> Verdict:
        return greedy_accept(block, logits.argmax(-1))

    rejection = staticmethod(rejection_accept)


class TritonAccept:
    """kernels.greedy_accept on the target's argmax / kernels.rejection_accept. The kernel can
    take the argmax itself from the logits, but one program per row scanning B x V logits is slower than
    torch.argmax (docs/performance.md#gpu-kernel-check-nvidia-h200-2026-12-04), so the engine hands it ids."""

    name = "triton"

    def __init__(self):
        self._greedy, self._rejection = kernels.greedy_accept, kernels.rejection_accept

    def greedy(self, block: torch.Tensor, logits: torch.Tensor) -> Verdict:
        return self._greedy(block, logits.argmax(-1))

    def rejection(self, draft, p, q, u_accept, u_sample) -> Verdict:
        return self._rejection(draft, p, q, u_accept, u_sample)


def accept_ops(mode: str, device: torch.device | str):
    """TorchAccept or TritonAccept for verification on `device` (mode as resolve())."""
    return TritonAccept() if resolve(mode, device) == "triton" else TorchAccept()
