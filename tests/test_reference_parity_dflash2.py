"""Parity of DFlash 2 (DFlash2DraftModel, dflash_trt/families/dflash2.py) with the authors' reference:
a checkpoint the reference class wrote (published layout: codebooks without `.weight`) loads; hidden
states, logits and the selector's greedy path agree to 1e-5; greedy generation equals dflash_generate
step for step for a drafter that accepts, and the target's greedy (batch 3, ragged); sampled output
follows the target (chi-square); saves load into the reference; what is not implemented is refused
with one line. Plain DFlash parity: tests/test_reference_parity.py.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import fp32_tol, tiny_config, tiny_hf
from parity_common import MASK, L, edit_config, generation_matches_reference, ref, train_until_it_accepts
from safetensors.torch import load_file, save_file

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.reference


D2_PLAIN = {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
D2_FIELDS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


def ref2_checkpoint(folder, seed: int = 0, published: bool = True):
    """A DFlash 2 checkpoint written by the reference's DFlash2DraftModel (random weights large enough
    that the convolutions and the selector's pair scores matter); published=True stores the codebooks
    without `.weight`, as the released checkpoints do."""
    torch.manual_seed(seed)
    cfg = tiny_config(
        "qwen3", num_target_layers=L, num_hidden_layers=2, block_size=4, dflash_config={**D2_PLAIN, **D2_FIELDS}
    )
    model = ref.DFlash2DraftModel(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "base_kernel" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    if published:
        state = load_file(str(folder / "model.safetensors"))
        state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def ref2_load(folder):
    model, info = ref.DFlash2DraftModel.from_pretrained(folder, output_loading_info=True)
    return model.float().eval(), info


def pair2(tmp_path, seed: int = 0):
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    folder = ref2_checkpoint(tmp_path / "d2", seed)
    return hf, target, DFlashDrafter.from_pretrained(folder, target=target), ref2_load(folder)[0], folder


def _propose(drafter, block, cache, rows):
    from dflash_trt.decoding.verify import sample_tokens, warp_logits

    return drafter.family.propose(drafter, block.clone(), cache, rows, False, warp_logits, sample_tokens)


def test_dflash2_states_logits_and_path_match_reference(tmp_path):
    hf, target, ours, theirs, _ = pair2(tmp_path)
    assert ours.family.NAME == "dflash2" and ours.kernels == "torch"
    toks = torch.randint(0, MASK, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = ref.extract_context_feature(hf(toks, output_hidden_states=True).hidden_states, theirs.target_layer_ids)
    B = ours.block_size
    rcache, dcache = ref._make_cache(theirs.config), ours.new_cache(1, 64)
    prev, start, greedy_row, differs = 0, 12, [(SamplingParams(), None)], False
    for accepted in (2, 0, 3, 1, 3, 0):
        block = torch.full((1, B), MASK)
        block[0, 0] = toks[0, start]
        with torch.no_grad():
            rh = theirs(
                target_hidden=feats[:, prev:start],
                noise_embedding=ref._raw_input_embeddings(hf, block),
                position_ids=torch.arange(prev, start + B)[None],
                past_key_values=rcache,
                use_cache=True,
            )
            ref._crop_to(rcache, start)
            rlogits = theirs.compute_logits(rh[:, 1:], hf.lm_head)
            rpath = theirs.propose(rh[:, 1:], block[:, 0], hf.lm_head, 0.0)[0]
        ours.inject_context(feats[:, prev:start], torch.tensor([start - prev]), dcache)
        torch.testing.assert_close(ours.draft_block(block, dcache), rh, **fp32_tol(rh))
        torch.testing.assert_close(ours.draft_logits(block, dcache), rlogits, **fp32_tol(rlogits))
        drafted, q, _ = _propose(ours, block, dcache, greedy_row)
        assert q is None and drafted[0, 0] == block[0, 0] and drafted[:, 1:].tolist() == rpath.tolist()
        differs |= not torch.equal(rpath, rlogits.argmax(-1))
        prev, start = start, start + accepted + 1
    assert differs  # the selector's pair scores changed some path: the walk itself was compared


def accepting_dflash2(tmp_path, hf, target, prompts):
    """A DFlash 2 checkpoint that gets drafts accepted, built by the reference class: the backbone of a
    plain DFlash drafter of the same shape trained on the target's continuations of `prompts`, the
    convolutions set to the identity (base tap 1 at offset 0, no dynamic part) and small random selector
    weights, so the selector walks a path close to the trained argmax yet still scores pairs."""
    cfg = tiny_config("qwen3", num_target_layers=L, num_hidden_layers=2, block_size=4, dflash_config=D2_PLAIN)
    torch.manual_seed(0)
    ref.DFlashDraftModel(cfg).float().save_pretrained(tmp_path / "plain")
    plain = train_until_it_accepts(
        DFlashDrafter.from_pretrained(tmp_path / "plain", target=target), target, prompts, 80
    )
    plain.save_pretrained(tmp_path / "plain_trained")
    d2 = ref.DFlash2DraftModel(
        tiny_config(
            "qwen3", num_target_layers=L, num_hidden_layers=2, block_size=4, dflash_config={**D2_PLAIN, **D2_FIELDS}
        )
    ).float()
    missing, unexpected = d2.load_state_dict(
        load_file(str(tmp_path / "plain_trained" / "model.safetensors")), strict=False
    )
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    with torch.no_grad():
        for name, p in d2.named_parameters():
            if "base_kernel" in name:
                p.zero_()
                p[:, 0] = 1.0  # prepare and finish: identity at offset 0
            elif "kernel_projection" in name:
                p.zero_()
            elif "candidate_selector" in name:
                p.copy_(0.05 * torch.randn_like(p))
    d2.save_pretrained(tmp_path / "d2_accepting")
    return tmp_path / "d2_accepting"


def test_dflash2_greedy_generation_matches_dflash_generate(tmp_path, monkeypatch):
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    g, n = torch.Generator().manual_seed(2), 16
    prompts = [torch.randint(0, MASK, (6,), generator=g).tolist() for _ in range(4)]
    folder = accepting_dflash2(tmp_path, hf, target, prompts)
    ours, theirs = DFlashDrafter.from_pretrained(folder, target=target), ref2_load(folder)[0]
    assert ours.family.NAME == "dflash2"
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    lengths = []
    for prompt in prompts[:2] + [torch.randint(0, MASK, (5,), generator=g).tolist()]:
        lengths += generation_matches_reference(hf, target, ours, theirs, prompt, n)
    assert sum(k > 1 for k in lengths) >= 4, lengths  # drafts do get accepted: the comparison has teeth


def test_dflash2_greedy_batch_equals_target_greedy(tmp_path):
    from dflash_trt.decoding.loop import generate, generate_baseline

    _, target, ours, _, _ = pair2(tmp_path, seed=4)
    prompts, params = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17]], SamplingParams(max_new_tokens=14)
    assert generate(target, ours, prompts, params).tokens == generate_baseline(target, prompts, params).tokens
    # a greedy row stays exact inside a batch of sampled rows (their q: per-row temperature, own generator)
    eng = SpecEngine(target, ours, max_batch=3, max_seq_len=64, kernels="torch")
    eng.add_request("s1", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=14, seed=1, ignore_eos=True))
    eng.add_request("g", prompts[2], params)
    eng.add_request("s2", [3], SamplingParams(temperature=0.7, top_k=5, max_new_tokens=14, seed=2, ignore_eos=True))
    got = []
    while eng.has_unfinished():
        got += [tok for o in eng.step() if o.request_id == "g" for tok in o.new_token_ids]
    assert got == generate_baseline(target, prompts[2:], params).tokens[0]


def test_dflash2_sampled_distribution_equals_target():
    """Lossless with the selector's q (k candidates, zero elsewhere): tokens 2 and 3 follow the
    target's own distribution (chi-square over N rows, as test_loop's)."""
    from test_loop import assert_follows_target

    from dflash_trt.config import DrafterConfig
    from dflash_trt.decoding.loop import generate

    V, N, prompt = 12, 3000, [3, 1, 4]
    t = TargetModel(tiny_hf("qwen3", vocab_size=V))
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    cfg = dataclasses.replace(
        cfg, architectures=["DFlash2DraftModel"], family_fields={**D2_FIELDS, "selector_top_k": 4}
    )
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 3.0 * p.shape[-1] ** -0.5)
    d = d.float().bind(t)
    out = generate(t, d, [prompt] * N, SamplingParams(temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True))
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate
    assert_follows_target(t, prompt, V, out.tokens)


def test_dflash2_save_load_round_trip(tmp_path):
    _, target, ours, _, _ = pair2(tmp_path)
    ours.save_pretrained(tmp_path / "ours")
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in saved  # the published layout
    theirs, info = ref2_load(tmp_path / "ours")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again = DFlashDrafter.from_pretrained(tmp_path / "ours", target=target)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert again.config.family_fields == D2_FIELDS
    assert DFlashDrafter.from_pretrained(ref2_checkpoint(tmp_path / "hf", published=False)).family.NAME == "dflash2"


def test_dflash2_refusals_are_one_line(tmp_path):
    from dflash_trt.errors import DFlashError
    from dflash_trt.modeling.fast_path import drafter_unsupported_reason
    from dflash_trt.train.objective import drafter_train_forward

    _, target, ours, _, folder = pair2(tmp_path)
    with pytest.raises(DFlashError, match="draft_cutoff=0.3: not supported for DFlash 2") as e:
        SpecEngine(target, ours, kernels="torch", draft_cutoff=0.3)
    assert "\n" not in str(e.value)
    assert "not DFlash 2" in drafter_unsupported_reason(ours.config)  # kernels=auto -> PyTorch, no CUDA graph
    assert "DFlash 2" in " ".join(ours.config.beyond_paper())  # TensorRT conversion refuses it
    from dflash_trt.train.objective import make_blocks  # training runs, convolutions included

    ids = torch.randint(0, MASK, (1, 16), generator=torch.Generator().manual_seed(0))
    taps = target.forward(ids, target.new_cache(1, 16), tap_layers=ours.target_layer_ids).taps
    blocks = make_blocks(ids, torch.tensor([[5, 9]]), torch.ones(1, 2, dtype=torch.bool), 4, MASK)
    hidden = drafter_train_forward(ours, taps, blocks)
    with torch.no_grad():
        for layer in ours.layers:  # identity convolutions: a different hidden state
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
    assert not torch.allclose(drafter_train_forward(ours, taps, blocks), hidden, atol=1e-3)
    edit_config(folder, **{"dflash_config.draft_vocab_size": 8})
    with pytest.raises(ConfigError, match="draft vocabularies are not supported for DFlash 2") as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)
    edit_config(folder, dflash_config={**D2_PLAIN, "conv_kernel_size": 3})
    with pytest.raises(CheckpointError, match=r"lacks dflash_config.conv_group_size, .* which a DFlash 2") as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)
    edit_config(folder, architectures=["DFlashDraftModel"], dflash_config={**D2_PLAIN, **D2_FIELDS})  # relabelled
    with pytest.raises(CheckpointError, match=r"dflash_config.conv_\w+=\d+: a DFlash 2 field, but architectures"):
        DFlashDrafter.from_pretrained(folder)
    edit_config(folder, dflash_config=D2_PLAIN)  # and then its tensors
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['candidate_selector"):
        DFlashDrafter.from_pretrained(folder)
