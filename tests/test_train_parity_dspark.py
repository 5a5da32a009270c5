"""Training-step parity of DSpark (dflash_trt/families/dspark.py train_terms through objective.family_loss,
teacher logits from features.target_block_logits as the trainer computes them) with SpecForge 0.2.0's
OnlineDSparkModel, for every Markov head type with the confidence head on (with and without its Markov
input), at SpecForge's loss weights (0.1 CE + 0.9 L1 + 1.0 confidence BCE): the same loss, each term,
the accuracy, every gradient, and the same weights after one BF16Optimizer step. Harness, the one stub
(the anchor draw) and the tolerance: tests/train_parity_common.py.

Pinned differences (docs/training.md, "Training-step parity with SpecForge"):
  * SpecForge trains B labels per block (offsets 1..B from positions 0..B-1); dflash-trt drafts and
    trains B-1 (a block holds the anchor and B-1 drafts). The parity batch masks SpecForge's B-th label
    (loss_mask 0 at anchor + B, the next anchor); unmasked it adds one more term per block.
  * sample_from_anchor=true is SpecForge's alignment. A plain DFlash backbone (block position k
    predicts token a+k) cannot start such a head: the trainer refuses the warm start (the cause of the
    2026-12-06 DSpark regression) and sample_from_anchor=false trains the backbone's own alignment.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf
from families_parity_common import B, DSparkDraftModel, dspark_fields
from parity_common import MASK, L
from train_parity_common import (
    S,
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

from dflash_trt.errors import ConfigError
from dflash_trt.train.features import target_block_logits
from dflash_trt.train.objective import family_loss
from dflash_trt.train.trainer import TrainConfig

pytestmark = pytest.mark.reference
GAMMA = 2.0  # SpecForge's DSpark decay exp(-k/gamma) over labels k = 0.. is ours exp(-(k-1)/gamma), k = 1..
ONLY = {"ce": (1.0, 0.0, 0.0), "l1": (0.0, 1.0, 0.0), "confidence": (0.0, 0.0, 1.0)}


def _setup(tmp_path, kind, with_markov):
    hf = frozen_target(tiny_hf("qwen3", num_hidden_layers=L))
    fields = dspark_fields(kind, anchor=True, with_markov=with_markov, confidence=True)
    ours, theirs = pair(tmp_path, DSparkDraftModel, fields, hf)
    ids, feats, last = batch(hf)
    anchors, keep = spaced_anchors()
    model = sf_model.OnlineDSparkModel(
        theirs, hf.lm_head, hf.model.embed_tokens, MASK, block_size=B, attention_backend="sdpa", loss_decay_gamma=GAMMA
    )
    blocks = our_blocks(ids, anchors, keep)
    teacher = target_block_logits(ours.target, ids, blocks.positions)  # the trainer's teacher logits
    return ours, theirs, fix_anchors(model, anchors, keep), ids, feats, last, blocks, teacher


def _their_terms(metrics):
    r = metrics["ratio_metrics"]
    return {k: r[f"{k}_loss"][0] / r[f"{k}_loss"][1] for k in ONLY}


@pytest.mark.parametrize("with_markov", [True, False])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_terms_gradients_and_step_match_specforge(tmp_path, kind, with_markov):
    ours, theirs, model, ids, feats, last, blocks, teacher = _setup(tmp_path, kind, with_markov)
    loss_mask = torch.ones(ids.shape)
    loss_mask[:, blocks.anchors[0]] = 0  # SpecForge's B-th label of each block (see the module docstring)
    loss, acc, metrics = model(ids, feats, loss_mask, target_last_hidden_states=last)
    assert float(metrics["ratio_metrics"]["acc"][1]) == blocks.valid.sum() * (B - 1)  # B-1 labels per block
    res = family_loss(ours, feats, blocks, GAMMA, teacher_logits=teacher)
    close(res.loss, loss, "loss")
    close(res.accuracy.mean(), acc, "accuracy")
    with torch.no_grad():
        for name, term in _their_terms(metrics).items():
            alphas = dict(zip(("ce_alpha", "l1_alpha", "conf_alpha"), ONLY[name]))
            close(family_loss(ours, feats, blocks, GAMMA, teacher_logits=teacher, **alphas).loss, term, name)
    loss.backward()
    res.loss.backward()
    grads_equal(ours, theirs)
    step_equal(ours, theirs)


def test_specforges_bth_label_is_one_more_term_per_block(tmp_path):
    """Unmasked, SpecForge also trains position B-1 on token a+B (where the next block's anchor is,
    or past the end for the last): its weight total is ours plus exp(-(B-1)/gamma) per block with
    that label, and its loss differs."""
    ours, theirs, model, ids, feats, last, blocks, teacher = _setup(tmp_path, "rnn", True)
    loss, _, metrics = model(ids, feats, torch.ones(ids.shape), target_last_hidden_states=last)
    w = torch.exp(-torch.arange(B, dtype=torch.float32) / GAMMA)
    with_bth = int((blocks.anchors + B < S).sum())  # the last block's a+B is past the end
    den = float(metrics["ratio_metrics"]["ce_loss"][1])
    assert den == pytest.approx(float(blocks.valid.sum() * w[:-1].sum() + with_bth * w[-1]), rel=1e-6)
    res = family_loss(ours, feats, blocks, GAMMA, teacher_logits=teacher)
    assert abs(float(res.loss.detach()) - float(loss.detach())) > 1e-3


@pytest.mark.parametrize(
    "family,fields,field",
    [
        ("dspark", {"markov_rank": 8}, "sample_from_anchor"),
        ("domino", {"emb_dim": 8, "gru_hidden_dim": 8, "shift_label": True}, "shift_label"),
    ],
)
def test_warm_start_from_a_dflash_backbone_refuses_the_next_token_alignment(family, fields, field):
    """A DFlash backbone's block position k predicts token a+k; a head drafting token a+k+1 from it
    starts misaligned (2026-12-06: DSpark 1.49 -> 1.12 held-out tau with the backbone frozen). One
    line naming the field and the fix; the same-position alignment is accepted."""
    with pytest.raises(ConfigError, match=f"family_fields.{field}") as err:
        TrainConfig(family=family, family_fields=fields, init_from="backbone/", freeze_backbone=True)
    assert "\n" not in str(err.value) and "false" in str(err.value)
    ok = {**fields, field: False}
    assert TrainConfig(family=family, family_fields=ok, init_from="backbone/", freeze_backbone=True).init_from
    assert TrainConfig(family=family, family_fields=fields).family == family  # no warm start: either is fine
