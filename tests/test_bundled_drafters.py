"""Bundled drafters: found by name, resolved wherever --drafter is accepted, preferred by the quickstart."""

import json

import pytest
import torch

from dflash_trt.errors import CheckpointError
from dflash_trt.hub.drafters import ASSETS, bundled_drafter_for, bundled_drafters, resolve_drafter
from tests.conftest import tiny_drafter, tiny_target


def _bundle(root, name="tiny-b4", target="tiny-qwen3", block_size=4):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=block_size, num_layers=1)
    d.save_pretrained(root / name)
    (root / name / "recipe.json").write_text(json.dumps({"target": target, "measured": {"tau": 2.5}}))
    return t, d


def test_bundled_drafter_is_found_by_name_and_target(tmp_path):
    _bundle(tmp_path)
    (tmp_path / "incomplete").mkdir()  # no weights: ignored, not an error
    found = bundled_drafters(tmp_path)
    assert list(found) == ["tiny-b4"]
    assert found["tiny-b4"].block_size == 4 and found["tiny-b4"].target == "tiny-qwen3"
    assert bundled_drafter_for("tiny-qwen3", root=tmp_path).name == "tiny-b4"
    assert bundled_drafter_for("/some/where/tiny-qwen3", 4, root=tmp_path).name == "tiny-b4"
    assert bundled_drafter_for("tiny-qwen3", 8, root=tmp_path) is None
    assert bundled_drafter_for("other", root=tmp_path) is None


def test_resolve_drafter_names_folders_and_errors(tmp_path):
    t, d = _bundle(tmp_path)
    assert resolve_drafter("tiny-b4", root=tmp_path) == str(tmp_path / "tiny-b4")
    assert resolve_drafter(str(tmp_path / "tiny-b4"), root=tmp_path) == str(tmp_path / "tiny-b4")
    with pytest.raises(CheckpointError, match="not a bundled drafter name.*bundled: tiny-b4"):
        resolve_drafter("nope", root=tmp_path)
    from dflash_trt.modeling.drafter import DFlashDrafter

    back = DFlashDrafter.from_pretrained(resolve_drafter("tiny-b4", root=tmp_path), target=t)
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_broken_recipe_is_a_clear_error(tmp_path):
    _bundle(tmp_path)
    (tmp_path / "tiny-b4" / "recipe.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tiny-b4.*recipe.json"):
        bundled_drafters(tmp_path)


def test_shipped_drafters_are_complete_and_load_their_config():
    from dflash_trt.config import DrafterConfig

    for b in bundled_drafters(ASSETS).values():
        cfg = DrafterConfig.load(b.path)
        assert cfg.block_size == b.block_size
        r = b.recipe
        assert r["commands"] and r["measured"]["tau"] > 1.0, f"{b.name}: recipe.json must record how and how well"


@pytest.mark.slow
def test_shipped_drafter_is_lossless_and_accepts_on_its_real_target():
    """The quickstart's drafter on the real SmolLM2: exact greedy output and a real acceptance length."""
    from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer, stop_ids
    from dflash_trt.config import SamplingParams
    from dflash_trt.decoding.loop import generate, generate_baseline

    b = bundled_drafter_for("smollm2-135m-instruct")
    if b is None:
        pytest.skip("no drafter bundled for smollm2-135m-instruct in this checkout")
    target, path = load_target(b.target, "float32", progress=False)
    tok = load_tokenizer(path)
    drafter = load_drafter(target, b.name)
    prompts = [
        encode(tok, "Write a Python function that returns the n-th Fibonacci number, with a docstring.", chat=True)
    ]
    params = SamplingParams(max_new_tokens=64, stop_token_ids=stop_ids(tok))
    out = generate(target, drafter, prompts, params)
    assert out.tokens == generate_baseline(target, prompts, params).tokens
    assert out.stats.tau > 1.5, f"bundled drafter accepts too little: tau {out.stats.tau:.2f}"
