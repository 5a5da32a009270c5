"""CPU weight packing (modeling/cpu_pack.py): same math as nn.Linear, same decoding, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import fp32_tol, tiny_drafter, tiny_model_dir, tiny_target
from torch import nn

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.cpu_pack import ENV_SWITCH, PackedLinear, pack_drafter, pack_target, pack_unavailable_reason

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 48), (1, 1, 48)])
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(48, 40, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(*shape)
    torch.testing.assert_close(
        packed(x), F.linear(x, lin.weight, lin.bias), **fp32_tol(F.linear(x, lin.weight, lin.bias), k=lin.in_features)
    )
    assert packed(x).shape == (*shape[:-1], 40)
    assert dict(packed.named_parameters()) == {} and packed.state_dict() == {}  # nothing to train or save
    twin = copy.deepcopy(packed)  # e.g. a drafter bound to a packed target deep-copies the target too
    torch.testing.assert_close(twin(x), packed(x), atol=0, rtol=0)
    assert packed.weight is None  # the dense copy is dropped ...
    assert PackedLinear(lin, keep_dense=True).weight is lin.weight  # ... or shared, not copied


@needs_onednn
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])  # qwen2: q/k/v biases
def test_packed_target_forward_and_decoding(family):
    dense = tiny_target(family)
    with torch.no_grad():  # HF initialises biases to zero: make Qwen2's q/k/v biases count
        for m in dense.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    packed = copy.deepcopy(dense)
    n = pack_target(packed)
    assert n == 2 * 7 + 1 and packed.packed and not dense.packed  # 2 layers x (q,k,v,o,gate,up,down) + head
    assert type(packed.hf.model.layers[0].mlp.down_proj) is PackedLinear and packed.hf.lm_head is packed.lm_head

    ids = torch.randint(0, 256, (2, 9))
    outs = []
    for t in (dense, packed):
        cache = t.new_cache(2, 32)
        outs.append(t.forward(ids, cache, tap_layers=[0, 1]))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].taps, outs[0].taps, atol=1e-4, rtol=1e-4)

    prompts = [[3, 14, 15, 92], [6, 53, 58, 97, 93, 23]]
    params = SamplingParams(max_new_tokens=12)
    base = generate_baseline(packed, prompts, params).tokens
    assert base == generate_baseline(dense, prompts, params).tokens
    drafter = tiny_drafter(packed, block_size=4)  # its head reads lm_head.weight, kept dense
    assert generate(packed, drafter, prompts, params).tokens == base
    # Hugging Face generate() runs the same packed modules (the bench's hf methods)
    hf_out = packed.hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
    assert hf_out[0, len(prompts[0]) :].tolist() == base[0]


def test_unavailable_reasons(monkeypatch):
    assert "not the CPU" in pack_unavailable_reason("cuda", torch.float32)
    assert "float16" in pack_unavailable_reason("cpu", torch.float16)
    assert "bfloat16" in pack_unavailable_reason("cpu", torch.bfloat16)  # already oneDNN: nothing to gain
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert pack_unavailable_reason("cpu", torch.float32) == f"{ENV_SWITCH}=0"


@needs_onednn
def test_load_target_packs_for_inference_only(tmp_path, monkeypatch):
    from dflash_trt.api import load_target

    folder = str(tiny_model_dir(tmp_path / "t"))
    assert load_target(folder, "float32", progress=False, device="cpu")[0].packed
    assert not load_target(folder, "float32", progress=False, device="cpu", for_training=True)[0].packed
    assert not load_target(folder, "float32", progress=False, device="cpu", packed=False)[0].packed
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not load_target(folder, "float32", progress=False, device="cpu")[0].packed
    with pytest.raises(DFlashError, match=f"cannot pack the target's CPU weights: {ENV_SWITCH}=0"):
        load_target(folder, "float32", progress=False, device="cpu", packed=True)


@needs_onednn
def test_tied_head_stays_tied_through_deepcopy():
    tied = tiny_target("qwen3", tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    pack_target(tied)
    assert tied.lm_head.weight is tied.embed_tokens.weight  # the drafter's head reads the embedding, no copy
    twin = copy.deepcopy(tied)
    assert twin.lm_head.weight is twin.embed_tokens.weight is not tied.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 5))
    torch.testing.assert_close(
        twin.forward(ids, twin.new_cache(1, 8)).logits, tied.forward(ids, tied.new_cache(1, 8)).logits, atol=0, rtol=0
    )


@needs_onednn
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_packed_drafter_drafts_the_same_and_still_saves(tmp_path, draft_vocab):
    """pack_drafter (load_drafter does it next to a packed target): same draft logits, greedy output
    still the target's, and state_dict / save_pretrained see the keys and values of before."""
    import dataclasses

    from dflash_trt.config import DrafterConfig
    from dflash_trt.modeling.drafter import DFlashDrafter

    target = tiny_target("qwen2")
    pack_target(target)
    cfg = DrafterConfig.for_target(target.config, num_layers=2, block_size=4)
    if draft_vocab:
        cfg = dataclasses.replace(cfg, draft_vocab_size=40)
    torch.manual_seed(3)
    dense = DFlashDrafter(cfg)
    with torch.no_grad():
        if draft_vocab:
            dense.draft_vocab.copy_(torch.arange(0, 200, 5))
        for p in dense.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    dense = dense.float().bind(target).eval()
    packed = copy.deepcopy(dense)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    assert pack_drafter(packed) == 1 + 2 * 7 and type(packed.layers[1].mlp["up_proj"]) is PackedLinear
    taps = torch.randn(2, 6, cfg.num_taps * target.config.hidden_size)
    block = torch.tensor([[5, cfg.mask_token_id, cfg.mask_token_id, cfg.mask_token_id]] * 2)
    logits = []
    for d in (dense, packed):
        cache = d.new_cache(2, 16)
        d.inject_context(taps, torch.tensor([6, 4]), cache)
        logits.append(d.draft_logits(block, cache))
    finite = torch.isfinite(logits[0])
    assert torch.equal(finite, torch.isfinite(logits[1]))
    torch.testing.assert_close(logits[1][finite], logits[0][finite], atol=1e-4, rtol=1e-4)
    prompts, params = [[3, 14, 15, 92], [6, 53, 58]], SamplingParams(max_new_tokens=12)
    assert generate(target, packed, prompts, params).tokens == generate_baseline(target, prompts, params).tokens
    assert set(packed.state_dict()) == set(before)
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in before.items())
    packed.save_pretrained(tmp_path / "d")
    again = DFlashDrafter.from_pretrained(tmp_path / "d", target=target)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in before.items())
    twin = copy.deepcopy(packed)
    assert type(twin.fc) is PackedLinear and set(twin.state_dict()) == set(before)
