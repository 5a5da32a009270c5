"""Shared by the DSpark / Domino reference parity tests (tests/test_reference_parity_families*.py, and
through them tests/test_train_parity_*.py): SpecForge 0.2.0's drafter classes (skips the importing
module where SpecForge is not installed, after parity_common's skip without the DFlash reference),
the tiny shapes and family fields, and checkpoints SpecForge writes and loads, paired with ours.
No tests here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, tiny_hf
from parity_common import MASK, L

from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

sf_dspark = pytest.importorskip(
    "specforge.modeling.draft.dspark", reason="SpecForge is not installed (.venv/bin/pip install specforge==0.2.0)"
)
# imported for the test modules (which import them from here), after the skip above
from specforge.modeling.draft.dflash import DFlashDraftModel as SFDFlash  # noqa: E402, F401
from specforge.modeling.draft.domino import DominoDraftModel  # noqa: E402, F401

DSparkDraftModel = sf_dspark.DSparkDraftModel

B = 4
PLAIN = {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
DOMINO = {"emb_dim": 16, "gru_hidden_dim": 12}


def dspark_fields(kind="rnn", anchor=True, with_markov=True, confidence=True):
    return {
        "markov_rank": 8,
        "markov_head_type": kind,
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": with_markov,
        "sample_from_anchor": anchor,
    }


def sf_config(fields):
    """A tiny SpecForge drafter config (GQA: SpecForge's DSpark default needs kv heads < heads)."""
    return tiny_config(
        "qwen3",
        num_target_layers=L,
        num_hidden_layers=2,
        block_size=B,
        num_key_value_heads=2,
        dflash_config={**PLAIN, **fields},
    )


def sf_checkpoint(cls, fields, folder, head_scale=3.0, seed=0):
    """A checkpoint written by SpecForge's `cls`: random weights, the heads' scaled by head_scale so
    that they change the argmax of some positions."""
    torch.manual_seed(seed)
    model = cls(sf_config(fields)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                head = any(k in name for k in ("markov", "confidence", "gru", "embed_proj"))
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5 * (head_scale if head else 1.0))
    model.save_pretrained(folder)
    return folder


def sf_load(cls, folder):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    return model.float().eval(), info


def pair(tmp_path, cls, fields, head_scale=3.0):
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    folder = sf_checkpoint(cls, fields, tmp_path / "sf", head_scale)
    return hf, target, DFlashDrafter.from_pretrained(folder, target=target), sf_load(cls, folder)[0], folder
