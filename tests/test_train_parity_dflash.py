"""Training-step parity of plain DFlash and its D-PACE loss with SpecForge 0.2.0's OnlineDFlashModel
(loss_type "dflash" and "dpace"), and of the update rule with SpecForge's BF16Optimizer: the same
weights (a SpecForge checkpoint loaded by both), the same batch and anchors give the same loss,
accuracy, every gradient, and the same weights after one optimizer step. Harness, the one stub (the
anchor draw) and the tolerance: tests/train_parity_common.py.

Pinned differences (docs/training.md, "Training-step parity with SpecForge"): the loss over a batch
where some labels do not count (scored text) is normalised per block, not pooled over tokens; the
warmup-cosine schedule is the closed form SpecForge's chained scheduler approximates; AdamW's beta2
is 0.95, not torch's 0.999 (the first step is the same).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_hf
from families_parity_common import B, SFDFlash
from parity_common import MASK, L
from train_parity_common import (
    REL,
    BF16Optimizer,
    batch,
    close,
    fix_anchors,
    frozen_target,
    grads_equal,
    our_blocks,
    pair,
    sf_model,
    spaced_anchors,
    step_equal,
)

from dflash_trt.train import objective
from dflash_trt.train.objective import cosine_lr, dflash_loss, dpace_loss, position_weights

pytestmark = pytest.mark.reference


def _setup(tmp_path, loss_type="dflash", gamma=None):
    hf = frozen_target(tiny_hf("qwen3", num_hidden_layers=L))
    ours, theirs = pair(tmp_path, SFDFlash, {}, hf)
    model = sf_model.OnlineDFlashModel(
        theirs,
        hf.lm_head,
        hf.model.embed_tokens,
        MASK,
        block_size=B,
        attention_backend="sdpa",
        loss_decay_gamma=gamma,
        loss_type=loss_type,
        dpace_alpha=0.5,
    )
    ids, feats, _ = batch(hf)
    anchors, keep = spaced_anchors()
    return ours, theirs, fix_anchors(model, anchors, keep), ids, feats, our_blocks(ids, anchors, keep)


@pytest.mark.parametrize("gamma", [2.0, None])  # None: SpecForge's default, no decay (ours: gamma = inf)
def test_dflash_loss_gradients_and_step_match_specforge(tmp_path, gamma):
    ours, theirs, model, ids, feats, blocks = _setup(tmp_path, gamma=gamma)
    loss, acc, metrics = model(ids, feats, torch.ones(ids.shape))
    res = dflash_loss(ours, feats, blocks, math.inf if gamma is None else gamma)
    close(res.loss, loss, "loss")
    close(res.accuracy.mean(), acc, "accuracy")  # every position of every block counts: equal counts
    loss.backward()
    res.loss.backward()
    grads_equal(ours, theirs)
    step_equal(ours, theirs)


def test_dpace_loss_gradients_and_step_match_specforge(tmp_path):
    ours, theirs, model, ids, feats, blocks = _setup(tmp_path, loss_type="dpace")
    loss, _, metrics = model(ids, feats, torch.ones(ids.shape))
    res = dpace_loss(ours, feats, blocks, 2.0, alpha=0.5)  # gamma only shapes the statistics
    close(res.loss, loss, "D-PACE loss")
    assert float(metrics["loss_terms"][1]) == ids.shape[0]  # both divide by the number of sequences
    loss.backward()
    res.loss.backward()
    grads_equal(ours, theirs)
    step_equal(ours, theirs)


def test_partly_labelled_blocks_are_normalised_per_block_not_pooled(tmp_path):
    """Scored text (corpus.py) counts a block position only while the text agrees with greedy
    decoding. SpecForge's equivalent, loss_mask 0 at those labels, pools the loss over the counted
    tokens; ours keeps every block's scale (sum of its w_k): the terms are SpecForge's, the
    denominator is n_blocks * sum(w), not sum of the counted w."""
    ours, theirs, model, ids, feats, blocks = _setup(tmp_path, gamma=2.0)
    loss_mask = torch.ones(ids.shape)
    loss_mask[0, blocks.anchors[0, :2] + 2] = 0  # two blocks lose positions 2.. (the mask is cumulative in ours)
    loss_mask[0, blocks.anchors[0, :2] + 3] = 0
    loss, _, metrics = model(ids, feats, loss_mask)
    blocks.label_mask = loss_mask.gather(1, blocks.positions[..., 1:].flatten(1)).view_as(blocks.labels).bool()
    res = dflash_loss(ours, feats, blocks, 2.0)
    num, den = metrics["loss_terms"]
    w = position_weights(B, 2.0)
    close(res.loss * blocks.valid.sum() * w.sum(), num, "the same weighted terms")
    assert float(den) < float(blocks.valid.sum() * w.sum()) - 0.5  # SpecForge: only the counted weights
    assert float(res.loss.detach()) < float(loss.detach()) * 0.95


@pytest.mark.parametrize("total,ratio", [(200, 0.015), (64, 0.04), (40, 0.0)])
def test_lr_schedule_is_specforges_closed_form(total, ratio):
    """SpecForge's CosineAnnealingWarmupLR: linear warmup over int(ratio * total) steps (exactly
    ours), then torch's recursive CosineAnnealingLR, which at the hand-over (or at step 0 with no
    warmup) overshoots the closed form by (pi / (total - warmup))^2 / 4 relative and then follows it."""
    opt = BF16Optimizer(torch.nn.Linear(1, 1), lr=1e-3, total_steps=total, warmup_ratio=ratio)
    warm = int(ratio * total)
    bound = (math.pi / (total - warm)) ** 2 / 4 * 1.05
    for step in range(total):
        theirs, ours = opt.get_learning_rate(), cosine_lr(step, total, 1e-3, ratio)
        if step < warm:
            assert theirs == pytest.approx(ours, rel=1e-12)
        assert abs(theirs - ours) <= bound * 1e-3, (step, theirs, ours)
        opt.optimizer.step()
        opt.scheduler.step()


def test_adam_betas_are_the_one_difference_of_the_update(monkeypatch):
    """Three updates with the same gradients (the later ones 10x smaller, where the second moment's
    memory matters; all in the warmup, where both schedules agree exactly): ours equal SpecForge's
    BF16Optimizer once ADAM_BETAS is torch's default, and differ from the second step on with ours
    (0.9, 0.95)."""
    g = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(64, generator=g), [torch.randn(64, generator=g) * s for s in (1.0, 0.1, 0.1)]

    def run(betas):
        monkeypatch.setattr(objective, "ADAM_BETAS", betas)
        p = torch.nn.Parameter(w0.clone())
        opt = objective.make_optimizer([p], 0.1, 0.0)
        for step, gr in enumerate(grads):
            p.grad = gr.clone()
            objective.optimizer_step(opt, [p], cosine_lr(step, 20, 0.1, 0.2), 0.5)
        return p.detach()

    holder = torch.nn.Linear(64, 1, bias=False)
    holder.weight.data.copy_(w0[None])
    sf = BF16Optimizer(holder, lr=0.1, max_grad_norm=0.5, total_steps=20, warmup_ratio=0.2)
    for gr in grads:
        holder.weight.grad = gr[None].clone()
        sf.step()
    assert objective.ADAM_BETAS == (0.9, 0.95)
    close(run((0.9, 0.999)), holder.weight.detach()[0], "two steps with torch's betas")
    apart = (run((0.9, 0.95)) - holder.weight.detach()[0]).abs().max()
    assert apart > 10 * REL * w0.abs().max(), apart  # far outside the tolerance of the equality above
