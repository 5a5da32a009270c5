"""Shared by the training-step parity tests (tests/test_train_parity_*.py): SpecForge 0.2.0's own online
training models (OnlineDFlashModel, OnlineDSparkModel, OnlineDominoModel) built around the same tiny
weights as a dflash-trt drafter, fed the same batch, and compared term by term, gradient by gradient,
and after one update of SpecForge's optimizer (BF16Optimizer) against ours (objective.optimizer_step).

Nothing of SpecForge is stubbed but the anchor draw: `_sample_anchor_positions` returns the anchors the
test chose (ours are drawn by objective.sample_anchors from another RNG). SpecForge's dense-mask path
(attention_backend="sdpa", a documented SpecForge option) runs on the CPU; flex attention (its GPU
default) builds the same mask from the same predicate (create_dflash_block_mask vs
create_dflash_sdpa_mask), and torch.distributed is simply not initialised (world size 1).

Tolerance: the two sides run the same fp32 operations in different orders (SpecForge's loss is pooled
over tokens, ours per block; attention over a dense [Q, S+Q] mask vs ours over [J*B, S+J*B]; the
reductions are over at most a few hundred terms: hidden 64, vocabulary 256, 8 blocks x 4 positions).
Each value then carries a rounding error of at most about n * 2^-24 ~ 1e-5 relative to the largest
value of its tensor, which is the bound used (REL).
"""

from __future__ import annotations

import torch
from families_parity_common import B, sf_checkpoint
from parity_common import MASK, L

from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel
from dflash_trt.train.objective import make_blocks, make_optimizer, optimizer_step

sf_model = __import__("pytest").importorskip("specforge.algorithms.common.dflash_family_model")
from specforge.modeling.draft.dflash import extract_context_feature  # noqa: E402
from specforge.optimizer import BF16Optimizer  # noqa: E402

REL = 1e-5
S = 4 * B + 4  # sequence length: room for 4 blocks spaced B apart after a short prompt
TAPS = [1, 3]  # the drafters' target_layer_ids (test_reference_parity_families.PLAIN)


def close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Equal to REL of the tensor's largest magnitude (see the module docstring)."""
    scale = float(theirs.detach().abs().max().clamp_min(1e-30))
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=REL, atol=REL * scale, msg=what)


def pair(tmp_path, cls, fields, hf, seed=0):
    """(our drafter, SpecForge's `cls`) holding the same random weights, both fp32 in train mode."""
    folder = sf_checkpoint(cls, fields, tmp_path / "sf", seed=seed)
    theirs = cls.from_pretrained(folder).float().train()
    ours = DFlashDrafter.from_pretrained(folder, target=TargetModel(hf)).float().train()
    return ours, theirs


def frozen_target(hf):
    hf.requires_grad_(False)
    return hf


def batch(hf, seed=1):
    """ids [2, S]; the taps SpecForge's online path concatenates (extract_context_feature) [2, S, 2d];
    the target's last hidden state after the final norm (SpecForge's target_last_hidden_states)."""
    ids = torch.randint(0, MASK, (2, S), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    assert len(hs) == L + 1
    return ids, extract_context_feature(hs, TAPS), hs[-1]


def spaced_anchors():
    """Anchors B apart ending at S - B, every block kept: [2, 4] each. Every label of ours exists and
    SpecForge's extra B-th label of a shifted block (anchor + B) is the next anchor, or past the end."""
    a = torch.arange(S - 4 * B, S - B + 1, B)
    return a.expand(2, -1).clone(), torch.ones(2, len(a), dtype=torch.bool)


def fix_anchors(model, anchors, keep):
    """Stub SpecForge's anchor draw (the only stub): these anchors and this keep mask."""
    model._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors, keep)
    return model


def our_blocks(ids, anchors, keep):
    return make_blocks(ids, anchors, keep, B, MASK)


def grads_equal(ours, theirs) -> None:
    """Every trainable parameter of both drafters (same names: the checkpoint layout is shared) has
    the same gradient; neither side has a gradient the other lacks."""
    po = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    pt = {n: p for n, p in theirs.named_parameters() if p.requires_grad}
    assert set(po) == set(pt)
    for n in sorted(po):
        assert (po[n].grad is None) == (pt[n].grad is None), n
        if po[n].grad is not None:
            close(po[n].grad, pt[n].grad, f"gradient of {n}")


def step_equal(ours, theirs, lr=3e-3, total=100, warmup_ratio=0.04, grad_clip=0.5) -> None:
    """With equal gradients in both, one update each: SpecForge's BF16Optimizer (AdamW, its clip, its
    warmup-cosine schedule; fp32 masters of fp32 weights) and ours (make_optimizer + optimizer_step at
    cosine_lr(0)); warmup_ratio 0.04 of 100 steps: both warm up over 4 steps, so lr/4 here.

    Adam's first update is lr * g / (|g| + 1e-8) per entry: it equals the other side's wherever the
    gradient is well above the two sides' gradient difference (10x REL of its tensor's largest entry, and
    1e-6 after clipping so that Adam's eps is negligible),
    and is at most lr anywhere; the weights then agree to that plus fp32 rounding of the weight."""
    from dflash_trt.train.objective import cosine_lr

    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    grads = {n: p.grad.clone() for n, p in theirs.named_parameters() if p.grad is not None}
    params = [p for p in ours.parameters() if p.requires_grad]
    step_lr = cosine_lr(0, total, lr, warmup_ratio)
    optimizer_step(make_optimizer(params, lr, 0.0), params, step_lr, grad_clip)
    BF16Optimizer(theirs, lr=lr, max_grad_norm=grad_clip, total_steps=total, warmup_ratio=warmup_ratio).step()
    pt = dict(theirs.named_parameters())
    assert grads
    norm = float(torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt())
    clip = min(1.0, grad_clip / (norm + 1e-6))  # both scale every gradient by this before Adam
    for n, p in ours.named_parameters():
        if n not in grads:
            assert torch.equal(p, before[n]) and torch.equal(pt[n], before[n]), f"{n} moved without a gradient"
            continue
        mine, sfs = p.detach() - before[n], pt[n].detach() - before[n]
        g = grads[n].abs()
        sure = g > max(10 * REL * float(g.max()), 1e-6 / clip)
        atol = REL * step_lr + 4 * torch.finfo(torch.float32).eps * float(before[n].abs().max())
        torch.testing.assert_close(mine[sure], sfs[sure], rtol=0, atol=atol, msg=f"update of {n}")
        assert float(mine.abs().max()) <= step_lr * (1 + 1e-4) + atol, n
        assert float(sfs[sure].abs().min()) > step_lr / 2, f"{n}: the update is not Adam's first step at lr"
