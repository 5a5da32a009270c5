"""Training-step parity of Domino (dflash_trt/families/domino.py train_terms through objective.family_loss)
with SpecForge 0.2.0's OnlineDominoModel, for both alignments (shift_label), a pure-draft prefix, and
the backbone CE mixed in (lambda_base): the same loss, accuracy, every gradient, and the same weights
after one BF16Optimizer step. Harness, the one stub (the anchor draw) and the tolerance:
tests/train_parity_common.py.

Pinned differences (docs/training.md, "Training-step parity with SpecForge"):
  * with shift_label SpecForge also trains position B-1 on token a+B (as DSpark; masked here by
    loss_mask 0 at the next anchor);
  * SpecForge's recipe decays lambda_base linearly from 1 to 0 over the first half of training
    (DominoTrainStrategy, linear_lambda_base); the trainer here trains the corrected logits alone
    (lambda_base 0), the parity holds at any fixed lambda_base (this test).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf
from families_parity_common import DOMINO, B, DominoDraftModel
from parity_common import MASK, L
from train_parity_common import (
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

from dflash_trt.train.objective import family_loss

pytestmark = pytest.mark.reference
GAMMA = 2.0


@pytest.mark.parametrize(
    "shift,prefix,lam", [(False, 0, 0.0), (False, 1, 0.3), (True, 0, 0.0), (True, 1, 0.3)], ids=str
)
def test_domino_loss_gradients_and_step_match_specforge(tmp_path, shift, prefix, lam):
    hf = frozen_target(tiny_hf("qwen3", num_hidden_layers=L))
    fields = {**DOMINO, "shift_label": shift, "pure_draft_prefix_len": prefix}
    ours, theirs = pair(tmp_path, DominoDraftModel, fields, hf)
    ids, feats, _ = batch(hf)
    anchors, keep = spaced_anchors()
    model = sf_model.OnlineDominoModel(
        theirs,
        hf.lm_head,
        hf.model.embed_tokens,
        MASK,
        block_size=B,
        attention_backend="sdpa",
        loss_decay_gamma=GAMMA,
        shift_label=shift,
    )
    fix_anchors(model, anchors, keep)
    blocks = our_blocks(ids, anchors, keep)
    loss_mask = torch.ones(ids.shape)
    loss_mask[:, anchors[0]] = 0  # SpecForge's B-th label with shift_label; no label otherwise
    loss, acc, metrics = model(ids, feats, loss_mask, lambda_base=lam)
    res = family_loss(ours, feats, blocks, GAMMA, lambda_base=lam)
    close(res.loss, loss, "loss")
    close(res.accuracy.mean(), acc, "accuracy")
    if lam:  # the backbone's CE alone, as SpecForge reports it
        close(family_loss(ours, feats, blocks, GAMMA, lambda_base=1.0).loss, metrics["base_loss"], "base CE")
    loss.backward()
    res.loss.backward()
    grads_equal(ours, theirs)
    step_equal(ours, theirs)
