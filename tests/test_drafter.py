"""Drafter forward against a slow, explicit reference; cache crop; checkpoint format."""

import dataclasses
import json

import pytest
import torch
from conftest import fp32_tol, tiny_drafter, tiny_target
from safetensors.torch import load_file

from dflash_trt.config import DrafterConfig, default_target_layer_ids
from dflash_trt.errors import CheckpointError, ConfigError, IncompatibleModelsError
from dflash_trt.modeling.drafter import DFlashDrafter


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [n, H, D], pos [n]
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def reference_draft(drafter, taps, block_ids, start):
    """One row, written out: context = taps at positions 0..C-1, block at start..start+B-1.

    Keys/values are explicitly [context ; block]; attention is a full softmax with a mask that
    lets every block query see every context entry and every block entry."""
    cfg = drafter.config
    eps, H, Hk, D = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    C, B = taps.shape[0], block_ids.shape[0]
    ctx = _rms(taps @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)
    ctx_pos, blk_pos = torch.arange(C), torch.arange(start, start + B)
    x = drafter.target.embed_tokens.weight[block_ids]
    for layer in drafter.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = _rope(_rms((h @ a.q_proj.weight.T).view(B, H, D), a.q_norm.weight, eps), blk_pos, cfg.rope_theta)
        k_ctx = _rope(_rms((ctx @ a.k_proj.weight.T).view(C, Hk, D), a.k_norm.weight, eps), ctx_pos, cfg.rope_theta)
        k_blk = _rope(_rms((h @ a.k_proj.weight.T).view(B, Hk, D), a.k_norm.weight, eps), blk_pos, cfg.rope_theta)
        v = torch.cat([(ctx @ a.v_proj.weight.T).view(C, Hk, D), (h @ a.v_proj.weight.T).view(B, Hk, D)])
        k = torch.cat([k_ctx, k_blk])  # [C+B, Hk, D]
        rep = H // Hk
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = torch.ones(B, C + B, dtype=torch.bool)  # context/block mask: everything visible
        scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(B, H * D)
        x = x + o @ a.o_proj.weight.T
        m = layer.mlp
        g = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = (
            x
            + (torch.nn.functional.silu(g @ m["gate_proj"].weight.T) * (g @ m["up_proj"].weight.T))
            @ m["down_proj"].weight.T
        )
    return _rms(x, drafter.norm.weight, eps)


@pytest.mark.parametrize("B", [2, 4, 16])
def test_drafter_matches_reference_ragged_batch(family, B):
    t = tiny_target(family)
    d = tiny_drafter(t, block_size=B)
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    width = d.config.num_taps * 64
    taps = torch.randn(3, max(lens), width, generator=gen)
    blocks = torch.randint(0, 256, (3, B), generator=gen)
    blocks[:, 1:] = d.mask_token_id
    cache = d.new_cache(3, 64)
    d.inject_context(taps, torch.tensor(lens), cache)
    assert cache.lengths.tolist() == lens
    out = d.draft_block(blocks, cache)
    assert cache.lengths.tolist() == lens  # the block is scratch
    for r, n in enumerate(lens):
        ref = reference_draft(d, taps[r, :n], blocks[r], n)
        torch.testing.assert_close(out[r], ref, **fp32_tol(ref))


def test_crop_then_rerun_equals_fresh():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    taps = torch.randn(2, 10, d.config.num_taps * 64)
    block = torch.tensor([[3, 0, 0, 0], [4, 0, 0, 0]])
    block[:, 1:] = d.mask_token_id
    cache = d.new_cache(2, 32)
    d.inject_context(taps[:, :6], torch.tensor([6, 6]), cache)
    d.draft_block(block, cache)
    d.inject_context(taps[:, 6:], torch.tensor([4, 4]), cache)  # later rejected
    d.draft_block(block, cache)
    cache.crop(torch.tensor([6, 6]))
    d.inject_context(taps[:, 6:8], torch.tensor([2, 2]), cache)
    again = d.draft_block(block, cache)
    fresh_cache = d.new_cache(2, 32)
    d.inject_context(taps[:, :8], torch.tensor([8, 8]), fresh_cache)
    fresh = d.draft_block(block, fresh_cache)
    torch.testing.assert_close(again, fresh, **fp32_tol(fresh))


def test_save_load_round_trip_exact(tmp_path):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=8)
    d.save_pretrained(tmp_path / "drafter")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == d.target_layer_ids
    assert cfg["num_target_layers"] == 2
    assert cfg["torch_dtype"] == "float32"  # what the tensors are, not the config's bfloat16 default
    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights)  # shared with the target, not saved
    d2 = DFlashDrafter.from_pretrained(tmp_path / "drafter", target=t)
    for (k, a), (k2, b) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert d2.config == dataclasses.replace(d.config, dtype="float32")


def test_loads_zlab_layout_with_unused_fields(tmp_path):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=16)
    d.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    # fields of the published z-lab configs this code does not use (and v5-style rope_parameters)
    cfg.update(
        {
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "layer_types": ["full_attention"] * 2,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": 1,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"},
        }
    )
    cfg["dflash_config"]["shift_label"] = False  # SpecForge's, harmless at its default
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    d2 = DFlashDrafter.from_pretrained(tmp_path / "d", target=t)
    assert d2.config.rope_theta == d.config.rope_theta
    d2.save_pretrained(tmp_path / "d2")  # fields the reference ignores too survive a round trip
    cfg2 = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg2["auto_map"] == cfg["auto_map"] and cfg2["dflash_config"]["shift_label"] is False
    # an unknown dflash_config key may change the math: refused with one line naming it
    cfg["dflash_config"]["some_future_option"] = 3
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dflash_config.some_future_option"):
        DFlashDrafter.from_pretrained(tmp_path / "d", target=t)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as published
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(2, 5) == [0, 1]


def test_for_target_mask_in_vocab():
    t = tiny_target("llama")
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    assert 0 <= cfg.mask_token_id < t.vocab_size and cfg.num_target_layers == 2


def test_checkpoint_errors(tmp_path):
    t = tiny_target("qwen3")
    with pytest.raises(CheckpointError, match="not a folder"):
        DFlashDrafter.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        DFlashDrafter.from_pretrained(tmp_path / "empty")
    d = tiny_drafter(t)
    d.save_pretrained(tmp_path / "d")
    w = tmp_path / "d" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt"):
        DFlashDrafter.from_pretrained(tmp_path / "d")


def test_incompatible_drafter_named_fields():
    t = tiny_target("qwen3")
    other = tiny_target("qwen3", num_hidden_layers=3, hidden_size=32, vocab_size=300)
    d = tiny_drafter(other)
    with pytest.raises(IncompatibleModelsError, match="hidden_size 32 != target hidden_size 64"):
        d.bind(t)


def test_block_size_one_rejected():
    t = tiny_target("qwen3")
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig.for_target(t.config, block_size=1)
