"""Parity with the authors' DFlash reference code (the `dflash` package: DFlashDraftModel,
dflash_generate, extract_context_feature), on tiny random Qwen3 and Llama targets.

Checkpoints are written by the reference classes themselves, with every config field the reference
honours (dflash_config over top-level precedence, input_embedding_scale, output_multiplier,
final_logit_softcapping, is_causal, layer_types + sliding_window, absent rope_theta, one-layer
default taps, a tap on the target's last layer); dflash-trt loads them and must agree:
  (a) tapped target states, drafter hidden states and logits to 1e-5 (fp32) over several rounds
      with a cropped cache;
  (b) greedy generation token for token, and the same tokens per verify step, as dflash_generate
      for a drafter trained until it accepts;
  (c) what dflash-trt saves loads into the reference with no missing or unexpected keys.
DFlash 2: tests/test_reference_parity_dflash2.py; shared helpers: tests/parity_common.py.
Checkpoints with something dflash-trt does not implement are refused with one line each.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import fp32_tol, tiny_config, tiny_hf
from parity_common import MASK, L, edit_config, generation_matches_reference, ref, train_until_it_accepts
from safetensors.torch import load_file, save_file

from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.reference
# name: (target family, reference config fields, config.json keys deleted after the reference saves)
VARIANTS = {
    "plain": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            block_size=4,
            rope_theta=1e6,
            dflash_config={"mask_token_id": MASK, "target_layer_ids": [0, 3]},
        ),
        (),
    ),
    # dflash_config.block_size beats the top level; output_multiplier only at the top level
    "fields": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            block_size=8,
            output_multiplier=0.5,
            use_sliding_window=True,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            dflash_config={
                "mask_token_id": MASK,
                "target_layer_ids": [1, 3],
                "block_size": 4,
                "input_embedding_scale": 2.0,
                "final_logit_softcapping": 3.0,
            },
        ),
        ("rope_parameters", "rope_theta"),
    ),
    # one layer, no target_layer_ids: taps [L // 2]; every layer causal
    "causal": (
        "llama",
        dict(num_hidden_layers=1, block_size=4, is_causal=True, dflash_config={"mask_token_id": MASK}),
        ("rope_parameters", "rope_theta"),
    ),
    # target_layer_ids only at the top level; layer_types derived from max_window_layers; bidirectional window
    "window": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            is_causal=False,
            use_sliding_window=True,
            sliding_window=2,
            max_window_layers=1,
            target_layer_ids=[2, 3],
            block_size=4,
            dflash_config={"mask_token_id": MASK},
        ),
        ("layer_types", "rope_parameters"),
    ),
}


def ref_checkpoint(folder, variant: str, seed: int = 0):
    """A checkpoint written by the reference's DFlashDraftModel, with weights large enough that
    drafts differ between positions."""
    _, fields, strip = VARIANTS[variant]
    torch.manual_seed(seed)
    model = ref.DFlashDraftModel(tiny_config("qwen3", num_target_layers=L, **fields)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    for k in strip:
        cfg.pop(k, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def ref_load(folder):
    model, info = ref.DFlashDraftModel.from_pretrained(folder, output_loading_info=True)
    return model.float().eval(), info


def pair(tmp_path, variant: str):
    family = VARIANTS[variant][0]
    hf = tiny_hf(family, num_hidden_layers=L)
    target = TargetModel(hf)
    folder = ref_checkpoint(tmp_path / variant, variant)
    return hf, target, DFlashDrafter.from_pretrained(folder, target=target), ref_load(folder)[0], folder


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_states_and_logits_match_reference(tmp_path, variant):
    hf, target, ours, theirs, _ = pair(tmp_path, variant)
    assert ours.target_layer_ids == list(theirs.target_layer_ids) and ours.block_size == theirs.block_size
    assert ours.config.rope_theta == theirs.config.rope_parameters["rope_theta"]  # 1e4 when absent
    toks = torch.randint(0, MASK, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = ref.extract_context_feature(hf(toks, output_hidden_states=True).hidden_states, theirs.target_layer_ids)
    taps = target.forward(toks, target.new_cache(1, 48), ours.target_layer_ids).taps
    torch.testing.assert_close(taps, feats, **fp32_tol(feats))  # the last layer's tap after the final norm

    B, scale = ours.block_size, float(ref._draft_value(theirs.config, "input_embedding_scale", 1.0))
    rcache, dcache = ref._make_cache(theirs.config), ours.new_cache(1, 64)
    prev, start = 0, 12
    for accepted in (2, 0, 3, 1, 3, 0):  # rounds: each keeps `accepted` drafts plus the bonus
        block = torch.full((1, B), MASK)
        block[0, 0] = toks[0, start]
        with torch.no_grad():
            rh = theirs(
                target_hidden=feats[:, prev:start],
                noise_embedding=ref._raw_input_embeddings(hf, block, scale),
                position_ids=torch.arange(prev, start + B)[None],
                past_key_values=rcache,
                use_cache=True,
            )
            ref._crop_to(rcache, start)
            rlogits = theirs.compute_logits(rh[:, 1:], hf.lm_head)
        ours.inject_context(feats[:, prev:start], torch.tensor([start - prev]), dcache)
        torch.testing.assert_close(ours.draft_block(block, dcache), rh, **fp32_tol(rh))
        torch.testing.assert_close(ours.draft_logits(block, dcache), rlogits, **fp32_tol(rlogits))
        prev, start = start, start + accepted + 1


@pytest.mark.parametrize("variant", ["fields", "causal"])
def test_greedy_generation_matches_dflash_generate(tmp_path, monkeypatch, variant):
    hf, target, ours, _, _ = pair(tmp_path, variant)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, MASK, (6,), generator=g).tolist() for _ in range(4)]
    train_until_it_accepts(ours, target, prompts, steps=80)
    ours.save_pretrained(tmp_path / "trained")
    theirs, info = ref_load(tmp_path / "trained")  # (c): what dflash-trt saves, the reference loads as is
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # return_stats synchronises CUDA otherwise
    n, lengths = 24, []
    for prompt in prompts[:2] + [torch.randint(0, MASK, (5,), generator=g).tolist()]:
        lengths += generation_matches_reference(hf, target, ours, theirs, prompt, n)
    assert sum(k > 1 for k in lengths) >= 4, lengths  # the trained drafter does get drafts accepted


def test_saved_checkpoints_load_into_reference(tmp_path):
    hf, target, ours, theirs, folder = pair(tmp_path, "fields")
    ours.save_pretrained(tmp_path / "again")
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["architectures"] == ["DFlashDraftModel"]
    again, info = ref_load(tmp_path / "again")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for k, v in theirs.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    for name in ("block_size", "target_layer_ids", "mask_token_id"):
        assert getattr(again, name) == getattr(theirs, name)
    for i, layer in enumerate(again.layers):
        a, b = layer.self_attn, theirs.layers[i].self_attn
        assert (a.is_causal, a.sliding_window) == (b.is_causal, b.sliding_window)
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        assert ref._draft_value(again.config, name) == ref._draft_value(theirs.config, name)


def test_draft_vocab_extension_and_portable_save(tmp_path):
    hf, target, ours, _, folder = pair(tmp_path, "plain")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab_size"] = 8
    (folder / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, "draft_vocab": torch.arange(0, 64, 8)}, str(folder / "model.safetensors"))
    with_vocab = DFlashDrafter.from_pretrained(folder, target=target)
    with_vocab.save_pretrained(tmp_path / "ext")
    assert "unexpected_keys" in ref_load(tmp_path / "ext")[1] and ref_load(tmp_path / "ext")[1]["unexpected_keys"]
    with_vocab.save_pretrained(tmp_path / "plain", portable=True)
    theirs, info = ref_load(tmp_path / "plain")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert "draft_vocab_size" not in json.loads((tmp_path / "plain" / "config.json").read_text())["dflash_config"]
    back = DFlashDrafter.from_pretrained(tmp_path / "plain", target=target)
    assert back.draft_vocab is None and back.config.draft_vocab_size is None


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"architectures": ["LlamaForCausalLM"]}, CheckpointError, r"architectures \['LlamaForCausalLM'\]"),
        ({"dflash_config.projector_type": "eagle"}, CheckpointError, "projector_type='eagle'"),
        ({"dflash_config.projector_type": "domino"}, CheckpointError, r"emb_dim, .*which a Domino drafter"),
        ({"dflash_config.shift_label": True}, CheckpointError, "shift_label=True: a Domino field"),
        ({"dflash_config.future_knob": 1}, CheckpointError, "dflash_config.future_knob: unknown"),
        ({"sliding_window": -4}, ConfigError, "sliding_window=-4"),
        ({"dflash_config.final_logit_softcapping": -1.0}, ConfigError, "final_logit_softcapping=-1.0"),
        ({"layer_types": ["linear_attention", "full_attention"]}, ConfigError, "layer_types .'linear_attention'."),
        ({"layer_types": ["full_attention"]}, ConfigError, "layer_types has 1 entries"),
        ({"dflash_config.output_multiplier": "x"}, ConfigError, "output_multiplier='x'"),
    ],
)
def test_bad_checkpoints_fail_with_one_line(tmp_path, change, error, match):
    folder = ref_checkpoint(tmp_path / "d", "fields")
    edit_config(folder, **change)
    with pytest.raises(error, match=match) as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)


def test_missing_tensor_and_softcap_zero(tmp_path):
    folder = ref_checkpoint(tmp_path / "d", "fields")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors .'layers.1.mlp.up_proj.weight'."):
        DFlashDrafter.from_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"))
    edit_config(folder, **{"dflash_config.final_logit_softcapping": 0})  # 0 is off, as in the reference
    assert DFlashDrafter.from_pretrained(folder).config.final_logit_softcapping is None


def test_kernel_path_routes_masked_drafters_to_torch(tmp_path):
    from dflash_trt.modeling.fast_path import drafter_unsupported_reason

    for variant in VARIANTS:
        cfg = DFlashDrafter.from_pretrained(ref_checkpoint(tmp_path / variant, variant)).config
        reason = drafter_unsupported_reason(dataclasses.replace(cfg, head_dim=32))  # a head_dim the kernels take
        assert (reason is not None and "block attention kernel has no mask" in reason) == (variant != "plain"), reason
