"""Parity of the DSpark and Domino drafter families (dflash_trt/families/dspark.py, domino.py) with
SpecForge 0.2.0's DSparkDraftModel and DominoDraftModel: a checkpoint SpecForge wrote loads; over
consecutive cached steps the hidden states, the teacher-forced corrected logits (apply_logits_head,
markov_head.sample_block_tokens) and the confidence head's sigmoid agree to 1e-5, and the greedy
draft path equals SpecForge's, for every Markov head type and both alignments and every Domino
variant; greedy generation equals SpecForge's spec_generate for drafters that accept, and the
target's greedy (batch 3, ragged, also with draft_length="confidence"); sampled output follows the
target (chi-square). Saves, other layouts and refusals: tests/test_reference_parity_families_checkpoints.py;
shared helpers: tests/families_parity_common.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fp32_tol, tiny_hf
from families_parity_common import (
    DOMINO,
    B,
    DominoDraftModel,
    DSparkDraftModel,
    SFDFlash,
    dspark_fields,
    pair,
    sf_config,
    sf_load,
)
from parity_common import MASK, L, our_generate, train_until_it_accepts
from safetensors.torch import load_file
from specforge.modeling.draft.dflash import extract_context_feature
from transformers import DynamicCache

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.families import domino, dspark
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.modeling.target import TargetModel

pytestmark = pytest.mark.reference

STEPS = 40  # training steps of the accepting backbone


def cached_steps(hf, ours, theirs):
    """Yields (block, their hidden, our hidden, our cache) over consecutive verify steps with varying
    accepted counts: SpecForge's forward on a DynamicCache as spec_generate runs it, ours on its cache."""
    toks = torch.randint(0, MASK, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = extract_context_feature(hf(toks, output_hidden_states=True).hidden_states, [1, 3])
    rcache, dcache, prev, start = DynamicCache(), ours.new_cache(1, 64), 0, 12
    for accepted in (2, 0, 3, 1):
        block = torch.full((1, B), MASK)
        block[0, 0] = toks[0, start]
        with torch.no_grad():
            rh = theirs(
                target_hidden=feats[:, prev:start],
                noise_embedding=hf.model.embed_tokens(block),
                position_ids=torch.arange(prev, start + B)[None],
                past_key_values=rcache,
                use_cache=True,
                is_causal=False,
            )
        rcache.crop(start - rcache.get_seq_length())  # transformers 5 crops by a negative count
        ours.inject_context(feats[:, prev:start], torch.tensor([start - prev]), dcache)
        oh = ours.draft_block(block, dcache)
        torch.testing.assert_close(oh, rh, **fp32_tol(rh))
        yield block, rh, oh, dcache
        prev, start = start, start + accepted + 1


def _propose(drafter, block, cache, needs=frozenset()):
    from dflash_trt.decoding.verify import sample_tokens, warp_logits

    return drafter.family.propose(
        drafter, block.clone(), cache, [(SamplingParams(), None)], needs, warp_logits, sample_tokens
    )


@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_states_logits_path_and_confidence_match_specforge(tmp_path, kind, anchor):
    with_markov = kind != "gated"  # the confidence head reads W1[prev] for two of the three
    hf, _, ours, theirs, _ = pair(tmp_path, DSparkDraftModel, dspark_fields(kind, anchor, with_markov))
    assert ours.family.NAME == "dspark" and ours.config.family_fields["sample_from_anchor"] is anchor
    g, differs = torch.Generator().manual_seed(3), 0
    for block, rh, oh, cache in cached_steps(hf, ours, theirs):
        sel = rh[:, : B - 1] if anchor else rh[:, 1:]  # the proposal positions of each alignment
        with torch.no_grad():
            base = hf.lm_head(sel)
            rtok, rlog = theirs.markov_head.sample_block_tokens(
                base, first_prev_token_ids=block[:, 0], hidden_states=sel
            )
            prev = torch.cat([block[:, :1], rtok[:, :-1]], 1)
            rconf = theirs.predict_confidence(sel, prev_token_ids=prev).sigmoid()
            forced = torch.randint(0, MASK, prev.shape, generator=g)  # teacher forcing off the greedy path
            rforced = theirs.apply_logits_head(base, prev_token_ids=forced, hidden_states=sel)
            ohid = dspark.proposal_hidden(ours, oh)
            torch.testing.assert_close(ohid, sel, **fp32_tol(sel))
            torch.testing.assert_close(dspark.corrected_logits(ours, ohid, prev), rlog, **fp32_tol(rlog))
            torch.testing.assert_close(dspark.corrected_logits(ours, ohid, forced), rforced, **fp32_tol(rforced))
            drafted, q, conf = _propose(ours, block, cache, frozenset({"confidence"}))
        assert q is None and drafted[0, 0] == block[0, 0] and drafted[:, 1:].tolist() == rtok.tolist()
        torch.testing.assert_close(conf["confidence"], rconf, **fp32_tol(rconf))
        differs += int((rlog.argmax(-1) != base.argmax(-1)).sum())
    assert differs  # the Markov head changed some argmax: the path compared is the head's


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("shift", [False, True])
def test_domino_states_logits_and_path_match_specforge(tmp_path, shift, prefix):
    fields = {**DOMINO, "shift_label": shift, "pure_draft_prefix_len": prefix}
    hf, _, ours, theirs, _ = pair(tmp_path, DominoDraftModel, fields, head_scale=1.5)
    assert ours.family.NAME == "domino"
    g, differs = torch.Generator().manual_seed(3), 0
    pos = [t - 1 if shift else t for t in range(1, B)]  # the block position that drafts token t
    for block, rh, oh, cache in cached_steps(hf, ours, theirs):
        with torch.no_grad():
            rtok = theirs._sample_draft_tokens(hf, rh, block.clone())
            drafted, q, _ = _propose(ours, block, cache)
            base = hf.lm_head(rh)[:, pos]
            for tokens in (torch.cat([block[:, :1], rtok], 1), torch.randint(0, MASK, (1, B), generator=g)):
                rl = theirs.apply_logits_head(
                    hf.lm_head(rh)[:, None],
                    prev_token_embeddings=hf.model.embed_tokens(tokens)[:, None],
                    hidden_states=rh[:, None],
                )[:, 0, pos]
                torch.testing.assert_close(domino.corrected_logits(ours, oh, tokens), rl, **fp32_tol(rl))
                differs += int((rl.argmax(-1) != base.argmax(-1)).sum())
        assert q is None and drafted[0, 0] == block[0, 0] and drafted[:, 1:].tolist() == rtok.tolist()
    assert differs  # the GRU correction changed some argmax


@pytest.fixture
def legacy_crop(monkeypatch):
    """SpecForge 0.2.0's spec_generate calls DynamicCache.crop(length), the pre-5 transformers
    meaning; transformers 5 takes a negative count to remove and raises on a positive one."""
    crop = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: crop(self, n - self.get_seq_length() if n > 0 else n))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(hf, target, prompts, backbone state): a plain SpecForge DFlash drafter of the families' shape
    trained on the target's continuations of `prompts` (once for the module: the costly part)."""
    tmp = tmp_path_factory.mktemp("plain")
    hf = tiny_hf("qwen3", num_hidden_layers=L)
    target = TargetModel(hf)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, MASK, (6,), generator=g).tolist() for _ in range(4)]
    torch.manual_seed(0)
    SFDFlash(sf_config({})).float().save_pretrained(tmp / "plain")
    plain = train_until_it_accepts(DFlashDrafter.from_pretrained(tmp / "plain", target=target), target, prompts, STEPS)
    plain.save_pretrained(tmp / "trained")
    return (
        hf,
        target,
        prompts + [torch.randint(0, MASK, (5,), generator=g).tolist()],
        load_file(str(tmp / "trained" / "model.safetensors")),
    )


def accepting(folder, backbone, cls, fields):
    """A `cls` checkpoint that gets drafts accepted, built by SpecForge: the trained plain backbone
    plus small random head weights (they score, yet mostly keep the trained argmax)."""
    torch.manual_seed(0)
    model = cls(sf_config(fields)).float()
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    heads = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")
    assert not unexpected and missing and all(k.startswith(heads) for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name in missing:
            p = model.get_parameter(name)
            p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "cls, fields",
    [(DominoDraftModel, DOMINO), (DSparkDraftModel, dspark_fields("rnn", anchor=False))],
    ids=["domino", "dspark_fill_in"],
)
def test_greedy_generation_matches_spec_generate(tmp_path, legacy_crop, trained, cls, fields):
    hf, target, prompts, backbone = trained
    folder = accepting(tmp_path / "acc", backbone, cls, fields)
    ours, theirs = DFlashDrafter.from_pretrained(folder, target=target), sf_load(cls, folder)[0]
    steps, n = [], 16
    for prompt in prompts[:2] + prompts[4:]:
        tokens, per_step = our_generate(target, ours, prompt, n)
        assert MASK not in tokens  # spec_generate drops mask ids from its output
        with torch.no_grad():
            res = theirs.spec_generate(
                target=hf, input_ids=torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=None, temperature=0.0
            )
        assert tokens == res[0, len(prompt) :].tolist()
        steps += per_step
    assert sum(k > 1 for k in steps) >= 6, steps  # drafts do get accepted: the comparison has teeth


def engine_generate(target, drafter, prompts, params, **engine_kw):
    """loop.generate with SpecEngine keyword arguments it does not pass (draft_length) -> (tokens, stats)."""
    from dflash_trt.decoding.stats import DecodeStats

    eng = SpecEngine(target, drafter, max_batch=len(prompts), max_seq_len=64, kernels="torch", **engine_kw)
    seed = params.seed
    eng.add_requests(
        [
            (str(r), p, dataclasses.replace(params, seed=None if seed is None else seed + r))
            for r, p in enumerate(prompts)
        ]
    )
    tokens, stats = {str(r): [] for r in range(len(prompts))}, DecodeStats()
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                stats.add(out.stats)
    return [tokens[str(r)] for r in range(len(prompts))], stats


@pytest.mark.parametrize("family", ["dspark", "domino", "dspark_confidence"])
def test_greedy_batch_equals_target_greedy(tmp_path, family):
    from dflash_trt.decoding.loop import generate, generate_baseline

    cls, fields = (DominoDraftModel, DOMINO) if family == "domino" else (DSparkDraftModel, dspark_fields("rnn"))
    _, target, ours, _, _ = pair(tmp_path, cls, fields)
    prompts, params = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17]], SamplingParams(max_new_tokens=14)
    want = generate_baseline(target, prompts, params).tokens
    if family != "dspark_confidence":
        assert generate(target, ours, prompts, params).tokens == want
        return
    tokens, stats = engine_generate(target, ours, prompts, params, draft_length="confidence", draft_cutoff=0.3)
    assert tokens == want
    assert stats.num_draft_tokens < (B - 1) * stats.num_verify_steps  # the confidence length acted
    assert stats.predicted_tau is not None and len(stats.predicted_per_position) == B - 1


@pytest.mark.parametrize("family", ["dspark", "domino", "dspark_confidence"])
def test_sampled_distribution_equals_target(family):
    """Lossless with the sequential q (each draft's q reads the drafts before it), and with a draft
    length the confidence head sets before each draft is drawn: tokens 2 and 3 follow the target's
    own distribution (chi-square over N rows, as test_loop's)."""
    from test_loop import assert_follows_target

    from dflash_trt.config import DrafterConfig

    V, N, prompt = 12, 600, [3, 1, 4]  # fewer rows than test_loop: the sequential heads draw per row
    t = TargetModel(tiny_hf("qwen3", vocab_size=V))
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=B)
    if family == "domino":
        arch, fields = "DominoDraftModel", {**domino.DEFAULTS, **DOMINO}
    else:
        arch, fields = "DSparkDraftModel", {**dspark.DEFAULTS, **dspark_fields("gated")}
    cfg = dataclasses.replace(cfg, architectures=[arch], family_fields=fields)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 3.0 * p.shape[-1] ** -0.5)
    d = d.float().bind(t)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=7, ignore_eos=True)
    kw = {"draft_length": "confidence", "draft_cutoff": 0.3} if family == "dspark_confidence" else {}
    tokens, stats = engine_generate(t, d, [prompt] * N, params, **kw)
    assert 0.05 < stats.acceptance_rate < 0.95, stats.acceptance_rate
    if kw:
        assert stats.num_draft_tokens < (B - 1) * stats.num_verify_steps  # the length rule acted
    assert_follows_target(t, prompt, V, tokens)
