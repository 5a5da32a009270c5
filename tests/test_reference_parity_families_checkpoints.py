"""DSpark and Domino checkpoints against SpecForge 0.2.0 (dflash_trt/families/dspark.py, domino.py):
saves load into SpecForge and back, the legacy `logit_head.` nesting and SGLang's projector_type
layout load; what is refused is refused with one line. The per-step and generation parity of the
same families: tests/test_reference_parity_families.py; shared helpers: tests/families_parity_common.py.
"""

from __future__ import annotations

import pytest
import torch
from families_parity_common import (
    DOMINO,
    B,
    DominoDraftModel,
    DSparkDraftModel,
    dspark_fields,
    pair,
    sf_checkpoint,
    sf_load,
)
from parity_common import edit_config
from safetensors.torch import load_file, save_file

from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.errors import CheckpointError, ConfigError, DFlashError
from dflash_trt.modeling.drafter import DFlashDrafter

pytestmark = pytest.mark.reference


@pytest.mark.parametrize(
    "cls, fields", [(DSparkDraftModel, dspark_fields("gated")), (DominoDraftModel, DOMINO)], ids=["dspark", "domino"]
)
def test_save_load_round_trip(tmp_path, cls, fields):
    _, target, ours, _, folder = pair(tmp_path, cls, fields)
    ours.save_pretrained(tmp_path / "ours")
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    theirs, info = sf_load(cls, tmp_path / "ours")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for k, v in theirs.state_dict().items():
        assert torch.equal(saved[k], v), k
    again = DFlashDrafter.from_pretrained(tmp_path / "ours", target=target)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert again.config.family_fields == ours.config.family_fields
    assert {k: again.config.family_fields[k] for k in fields} == fields
    # the early SpecForge layout: the heads nested under logit_head.
    state = load_file(str(folder / "model.safetensors"))
    heads = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")
    save_file(
        {("logit_head." + k if k.startswith(heads) else k): v for k, v in state.items()},
        str(folder / "model.safetensors"),
    )
    legacy = DFlashDrafter.from_pretrained(folder, target=target)
    for k, v in ours.state_dict().items():
        assert torch.equal(legacy.state_dict()[k], v), k


def test_sglang_domino_layout_loads(tmp_path):
    """SGLang's layout: architectures DFlashDraftModel, the family named by dflash_config.projector_type."""
    _, target, ours, _, folder = pair(tmp_path, DominoDraftModel, DOMINO)
    edit_config(folder, architectures=["DFlashDraftModel"])
    sglang = DFlashDrafter.from_pretrained(folder, target=target)
    assert sglang.family.NAME == "domino" and sglang.config.family_fields == ours.config.family_fields
    for k, v in ours.state_dict().items():
        assert torch.equal(sglang.state_dict()[k], v), k


def _refused(folder, error, match, **changes):
    if changes:
        edit_config(folder, **changes)
    with pytest.raises(error, match=match) as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)


def test_refusals_are_one_line(tmp_path):
    _, target, ours, _, folder = pair(tmp_path, DSparkDraftModel, dspark_fields("rnn"))
    with pytest.raises(ConfigError, match="draft_length=confidence needs draft_cutoff > 0") as e:
        SpecEngine(target, ours, kernels="torch", draft_length="confidence", draft_cutoff=0.0)
    assert "\n" not in str(e.value)
    _refused(
        folder, ConfigError, "markov_head_type='lstm': choose one of", **{"dflash_config.markov_head_type": "lstm"}
    )
    _refused(folder, ConfigError, "markov_rank=-1: must be an integer >= 0", **{"dflash_config.markov_rank": -1})
    edit_config(folder, **{"dflash_config.markov_head_type": "rnn", "dflash_config.markov_rank": 0})
    _refused(folder, ConfigError, "confidence_head_with_markov=true needs markov_rank > 0", markov_rank=0)
    edit_config(folder, markov_rank=8, **{"dflash_config.markov_rank": 8})
    _refused(
        folder, ConfigError, "draft vocabularies are not supported for DSpark", **{"dflash_config.draft_vocab_size": 8}
    )
    edit_config(folder, **{"dflash_config.draft_vocab_size": None})
    _refused(
        folder,
        ConfigError,
        "projector_type='domino': a DSpark drafter has 'dspark'",
        **{"dflash_config.projector_type": "domino"},
    )
    edit_config(folder, **{"dflash_config.projector_type": "dspark"})
    DFlashDrafter.from_pretrained(folder)  # the edits are undone: what follows is refused for its own reason
    state = load_file(str(folder / "model.safetensors"))
    del state["markov_head.markov_w2.weight"]
    save_file(state, str(folder / "model.safetensors"))
    _refused(folder, CheckpointError, r"markov_head\.markov_w2\.weight")
    # a DSpark drafter without the confidence head has no confidence to set the length from
    _, target, plain, _, _ = pair(
        tmp_path / "noconf", DSparkDraftModel, dspark_fields("vanilla", with_markov=False, confidence=False)
    )
    with pytest.raises(DFlashError, match="draft_length=confidence: this DSpark drafter has no confidence head") as e:
        SpecEngine(target, plain, kernels="torch", draft_length="confidence", draft_cutoff=0.3)
    assert "\n" not in str(e.value)
    folder = sf_checkpoint(DominoDraftModel, DOMINO, tmp_path / "dom")
    _refused(
        folder,
        ConfigError,
        r"pure_draft_prefix_len=3: must be an integer in 0\.\.2",
        **{"dflash_config.pure_draft_prefix_len": B - 1},
    )
