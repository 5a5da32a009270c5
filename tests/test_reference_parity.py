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
DFlash 2 (DFlash2DraftModel, dflash_trt/families/dflash2.py): a checkpoint the reference class wrote
(published layout: codebooks without `.weight`) loads; hidden states, logits and the selector's greedy
path agree to 1e-5; greedy generation equals dflash_generate step for step and the target's greedy
(batch 3, ragged); sampled output follows the target (chi-square); saves load into the reference.
Checkpoints with something dflash-trt does not implement are refused with one line each.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import tiny_config, tiny_hf
from safetensors.torch import load_file, save_file

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel
from dflash_trt.train.objective import dflash_loss, make_blocks, sample_anchors

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference is not installed " "(.venv/bin/pip install --no-deps dflash==0.1.0)"
)
pytestmark = pytest.mark.reference

L = 4  # target layers: taps can include the last one (L-1), read after the final norm
MASK = 255
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
    torch.testing.assert_close(taps, feats, atol=1e-5, rtol=1e-5)  # the last layer's tap after the final norm

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
        torch.testing.assert_close(ours.draft_block(block, dcache), rh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.draft_logits(block, dcache), rlogits, atol=1e-5, rtol=1e-5)
        prev, start = start, start + accepted + 1


def train_until_it_accepts(drafter, target, prompts, steps: int):
    """A few hundred tiny steps on the target's own greedy continuations of `prompts`."""
    with torch.no_grad():
        seqs = [p + greedy(target, p, 24) for p in prompts]
    ids = torch.tensor(seqs)
    no_logits = torch.zeros(len(seqs), 0, dtype=torch.long)
    taps = target.forward(
        ids, target.new_cache(len(seqs), ids.shape[1]), drafter.target_layer_ids, logits_at=no_logits
    ).taps
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        anchors, valid = sample_anchors(
            [ids.shape[1]] * len(seqs), [len(prompts[0])] * len(seqs), 8, drafter.block_size, g
        )
        out = dflash_loss(drafter, taps, make_blocks(ids, anchors, valid, drafter.block_size, MASK), 2.0)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


def greedy(target, prompt, n):
    cache = target.new_cache(1, len(prompt) + n + 1)
    out = target.prefill([prompt], cache)
    toks = [int(out.logits[0, -1].argmax())]
    while len(toks) < n:
        toks.append(int(target.forward(torch.tensor([[toks[-1]]]), cache).logits[0, -1].argmax()))
    return toks


def our_generate(target, drafter, prompt, n):
    """-> (generated tokens, tokens per verify step) from SpecEngine on the PyTorch path."""
    eng = SpecEngine(target, drafter, max_batch=1, max_seq_len=len(prompt) + n + 1, kernels="torch")
    eng.add_request("0", prompt, SamplingParams(max_new_tokens=n))
    tokens, per_step = [], []
    while eng.has_unfinished():
        for out in eng.step():
            per_step.append(len(out.new_token_ids) - (1 if not tokens else 0))  # the first holds prefill's token
            tokens += out.new_token_ids
    return tokens, per_step


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
        res = ref.dflash_generate(
            theirs, hf, torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=None, return_stats=True
        )
        tokens, per_step = our_generate(target, ours, prompt, n)
        assert tokens == res.output_ids[0, len(prompt) :].tolist()
        # the reference drafts a shorter block once fewer than B tokens remain: compare the full blocks
        full, pos = 0, len(prompt)
        for k in res.acceptance_lengths:
            if pos + ours.block_size > len(prompt) + n:
                break
            full, pos = full + 1, pos + k
        assert per_step[:full] == res.acceptance_lengths[:full], (per_step, res.acceptance_lengths)
        lengths += res.acceptance_lengths
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


def _edit(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if "." in k:
            outer, inner = k.split(".")
            cfg[outer][inner] = v
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


# ---- DFlash 2 (DFlash2DraftModel: grouped dynamic convolutions + candidate selector) -------------
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
        torch.testing.assert_close(ours.draft_block(block, dcache), rh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.draft_logits(block, dcache), rlogits, atol=1e-5, rtol=1e-5)
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
        res = ref.dflash_generate(
            theirs, hf, torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=None, return_stats=True
        )
        tokens, per_step = our_generate(target, ours, prompt, n)
        assert tokens == res.output_ids[0, len(prompt) :].tolist()
        full, pos = 0, len(prompt)  # full blocks only: the reference drafts a shorter last block
        for k in res.acceptance_lengths:
            if pos + ours.block_size > len(prompt) + n:
                break
            full, pos = full + 1, pos + k
        assert per_step[:full] == res.acceptance_lengths[:full], (per_step, res.acceptance_lengths)
        lengths += res.acceptance_lengths
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
    from test_loop import _exact_marginals
    from test_verify import chi2_pvalue

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
    for col, exp in zip((1, 2), _exact_marginals(t, prompt, V)):
        got = torch.bincount(torch.tensor([x[col] for x in out.tokens]), minlength=V).numpy()
        keep = exp * N > 5
        assert chi2_pvalue(got[keep.numpy()], exp[keep]) > 1e-3


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
    with pytest.raises(ConfigError, match="training a DFlash 2 drafter is not supported"):
        drafter_train_forward(ours, None, None)  # refused before it reads its inputs
    _edit(folder, **{"dflash_config.draft_vocab_size": 8})
    with pytest.raises(ConfigError, match="draft vocabularies are not supported for DFlash 2") as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)
    _edit(folder, dflash_config={**D2_PLAIN, "conv_kernel_size": 3})
    with pytest.raises(CheckpointError, match=r"lacks dflash_config.conv_group_size, .* which a DFlash 2") as e:
        DFlashDrafter.from_pretrained(folder)
    assert "\n" not in str(e.value)
    _edit(folder, architectures=["DFlashDraftModel"], dflash_config={**D2_PLAIN, **D2_FIELDS})  # relabelled
    with pytest.raises(CheckpointError, match=r"dflash_config.conv_\w+: a DFlash 2 field, but architectures"):
        DFlashDrafter.from_pretrained(folder)
    _edit(folder, dflash_config=D2_PLAIN)  # and then its tensors
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['candidate_selector"):
        DFlashDrafter.from_pretrained(folder)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"architectures": ["LlamaForCausalLM"]}, CheckpointError, r"architectures \['LlamaForCausalLM'\]"),
        ({"dflash_config.projector_type": "domino"}, CheckpointError, "projector_type='domino'"),
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
    _edit(folder, **change)
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
    _edit(folder, **{"dflash_config.final_logit_softcapping": 0})  # 0 is off, as in the reference
    assert DFlashDrafter.from_pretrained(folder).config.final_logit_softcapping is None


def test_kernel_path_routes_masked_drafters_to_torch(tmp_path):
    from dflash_trt.modeling.fast_path import drafter_unsupported_reason

    for variant in VARIANTS:
        cfg = DFlashDrafter.from_pretrained(ref_checkpoint(tmp_path / variant, variant)).config
        reason = drafter_unsupported_reason(dataclasses.replace(cfg, head_dim=32))  # a head_dim the kernels take
        assert (reason is not None and "block attention kernel has no mask" in reason) == (variant != "plain"), reason


def test_tensorrt_conversion_refuses_fields_it_lacks(tmp_path):
    from dflash_trt.deploy.convert import convert_drafter

    with pytest.raises(ConfigError, match="dflash_config.input_embedding_scale, .*TensorRT-LLM drafter"):
        convert_drafter(ref_checkpoint(tmp_path / "d", "fields"), tmp_path / "trt")
