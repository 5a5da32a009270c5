"""Hybrid proposer (decoding/proposers/hybrid.py, records.py + ngram.py in the engine): greedy output equals
the target's (batch 3, ragged), copied drafts do get accepted where the text repeats itself, sampled output
follows the target's distribution (chi-square), the choice rule itself, and the one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from test_loop import assert_follows_target

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding import records
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.ngram import NgramProposal
from dflash_trt.decoding.proposers import hybrid
from dflash_trt.decoding.session import Session
from dflash_trt.decoding.verify_cost import VerifyCost
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.drafter import DFlashDrafter


def _looping_target(V: int = 12):
    """A tiny target whose greedy text falls into short cycles (peaky LM head): its output repeats
    earlier text, which is what copied drafts are for."""
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(6.0)
    return t


def test_greedy_hybrid_equals_target_greedy_and_copies_get_accepted():
    t = _looping_target()
    d = tiny_drafter(t, block_size=4)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = generate_baseline(t, prompts, params).tokens
    out = generate(t, d, prompts, params, kernels="torch", proposer="hybrid")
    assert out.tokens == base
    src = out.stats.sources
    assert src["copied"]["steps"] > 0 and src["copied"]["accepted"] > 0, src
    plain = generate(t, d, prompts, params, kernels="torch")
    assert out.stats.num_verify_steps < plain.stats.num_verify_steps  # copying paid here


def test_ngram_proposer_greedy_equals_target_and_copies():
    t = _looping_target()
    d = tiny_drafter(t, block_size=4)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    out = generate(t, d, prompts, params, kernels="torch", proposer="ngram")
    assert out.tokens == generate_baseline(t, prompts, params).tokens
    src = out.stats.sources
    assert src["drafter"]["drafts"] == 0 and src["copied"]["accepted"] > 0, src  # the drafter never drafted


def test_none_proposer_is_plain_decoding():
    """proposer=none (the served baseline): the target's own output, one verified token per step (stats
    summed over 3 rows), and the drafter never runs (a drafter that raises on use proves it); cutoffs are
    refused in one line."""
    t = _looping_target()
    d = tiny_drafter(t, block_size=4)
    d.inject_context = d.forward = None  # any drafter call fails
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    out = generate(t, d, prompts, params, kernels="torch", proposer="none")
    assert out.tokens == generate_baseline(t, prompts, params).tokens
    assert out.stats.num_verify_steps == 3 * 19 and out.stats.sources["drafter"]["drafts"] == 0, out.stats.sources
    with pytest.raises(DFlashError, match="proposer=none: plain decoding verifies no drafts"):
        SpecEngine(t, d, kernels="torch", proposer="none", draft_cutoff=0.3)


def test_hybrid_with_draft_cutoff_stays_exact():
    t = _looping_target()
    d = tiny_drafter(t, block_size=4)
    prompts, params = [[5, 6, 7], [1, 2]], SamplingParams(max_new_tokens=24, ignore_eos=True)
    out = generate(t, d, prompts, params, kernels="torch", proposer="hybrid", draft_cutoff=0.2)
    assert out.tokens == generate_baseline(t, prompts, params).tokens


def test_sampled_hybrid_distribution_equals_target():
    """Copied drafts are point masses: accepted with probability p(token), else the residual. Tokens 2
    and 3 follow the target's own distribution (chi-square), with copies verified on many rows."""
    V, N, prompt = 12, 3000, [4, 2, 3, 4, 2]  # "4 2" seen before: copies "3 4 2" (target: p(3) = 0.51)
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    d = tiny_drafter(t, block_size=4, scale=0.3)  # an unsure drafter: the copy wins the first round
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    out = generate(t, d, [prompt] * N, params, kernels="torch", proposer="hybrid")
    src = out.stats.sources["copied"]
    assert src["steps"] > N // 10 and 0 < src["accepted"] < src["drafts"], src  # copies judged, both verdicts
    assert_follows_target(t, prompt, V, out.tokens)


def test_sampled_ngram_distribution_equals_target():
    V, N, prompt = 12, 3000, [4, 2, 3, 4, 2]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    out = generate(t, tiny_drafter(t, block_size=4), [prompt] * N, params, kernels="torch", proposer="ngram")
    src = out.stats.sources["copied"]
    assert src["steps"] > N // 3 and 0 < src["accepted"] < src["drafts"], src
    assert_follows_target(t, prompt, V, out.tokens)


def test_choose_takes_the_copy_only_when_it_expects_more():
    block = torch.tensor([[5, 1, 1, 1], [5, 1, 1, 1]])
    q = torch.full((2, 3, 8), 0.125)
    n = torch.tensor([3, 3])
    prob = torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]])  # drafter expects 2.44 and 0.11 accepted
    props = [NgramProposal([6, 7], 3), NgramProposal([6, 7], 3)]
    chosen = hybrid.choose(block, q, n, prob, props, [[0.5, 0.25, 0.125]] * 2)  # copy expects 0.75
    assert chosen == [False, True]
    assert block.tolist() == [[5, 1, 1, 1], [5, 6, 7, 1]] and n.tolist() == [3, 2]
    assert q[1, 0, 6] == 1 and q[1, 0].sum() == 1 and q[1, 1, 7] == 1 and torch.equal(q[0], torch.full((3, 8), 0.125))
    assert hybrid.choose(block, None, n, prob, [NgramProposal([], 0)] * 2, [[0.9] * 3] * 2) == [False, False]


def test_copy_survival_is_per_position():
    rec = records.NgramRecord()
    assert rec.survival(2) == pytest.approx([0.5, 0.5 * records.CONTINUE_PRIOR])  # no data: the priors
    for _ in range(3):  # all or nothing: three copies of 4 taken whole, three rejected at once
        rec.record_copy(4, 4)
        rec.record_copy(4, 0)
    s = rec.survival(4)
    assert rec.reached == [6, 3, 3, 3] and rec.hits == [3, 3, 3, 3]
    assert s[0] == pytest.approx(0.5) and s[3] == pytest.approx(0.5 * ((3 + 1.6) / 5) ** 3)  # not 0.5**4


def test_a_new_request_starts_from_the_shared_history():
    """A request's record starts from the earlier requests' verdicts (DrafterRecord.start, at most
    PRIOR_WEIGHT pseudo-observations), and its own verdicts take over."""
    rec = records.DrafterRecord()
    first = rec.start()
    assert first.survival(3) == pytest.approx([0.5, 0.4, 0.32])  # no history: the priors alone
    for _ in range(20):
        first.record_copy(4, 4)  # every copy accepted whole
    first.record_drafter(10.0, 1)  # a drafter that expected 10 accepted drafts and got 1
    second = rec.start()
    s = second.survival(4)
    assert s == pytest.approx([0.9, 0.864, 0.82944, 0.7962624], rel=1e-6)  # 8 pseudo-copies, all accepted
    assert second.calibration == pytest.approx((0.8 + 1) / (8 + 1), rel=1e-3)
    assert first.survival(1)[0] == pytest.approx(21 / 22)  # the first request's own counts are its own
    for _ in range(10):
        second.record_copy(4, 0)  # this request's copies fail at once
    assert second.survival(1)[0] < 0.5
    # every verdict also went to the history, which decays by 0.99 per verdict recorded (31 here)
    decayed = sum(0.99**k for k in range(20)) * 0.99**11 + sum(0.99**k for k in range(10))
    assert rec.history.reached[0] == pytest.approx(decayed, rel=1e-9)


def test_a_second_request_copies_from_its_first_round(monkeypatch):
    """Same looping text twice over one drafter: the second request knows copies pay before its own
    first verdict, so it needs no more rounds than the first and verifies copies at least as often.
    A flat verify cost (every width as cheap as one token), so that no copy is cut for this machine's
    measured timings: the choice between sources is what is compared."""
    monkeypatch.setattr(VerifyCost, "measure", classmethod(lambda cls, *a, **k: cls([1, 512], [1.0, 1.0])))
    t = _looping_target()
    d = tiny_drafter(t, block_size=4, scale=0.3)
    prompt, params = [[1, 2, 3, 4, 5, 1, 2, 3]], SamplingParams(max_new_tokens=40, ignore_eos=True)
    session = Session()  # the history carried from the first call to the second
    first = generate(t, d, prompt, params, kernels="torch", proposer="hybrid", session=session).stats
    second = generate(t, d, prompt, params, kernels="torch", proposer="hybrid", session=session).stats
    assert second.num_verify_steps <= first.num_verify_steps
    assert second.sources["copied"]["steps"] >= first.sources["copied"]["steps"] > 0


def test_auto_is_hybrid_where_the_family_gives_probabilities():
    t = tiny_target("qwen3")
    assert SpecEngine(t, tiny_drafter(t), kernels="torch", proposer="auto").proposer.name == "hybrid"
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    cfg = dataclasses.replace(
        cfg,
        architectures=["DFlash2DraftModel"],
        family_fields={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3},
    )
    assert SpecEngine(t, DFlashDrafter(cfg).bind(t), kernels="torch", proposer="auto").proposer.name == "dflash"


def test_refusals_are_one_line():
    t = tiny_target("qwen3")
    with pytest.raises(DFlashError, match="proposer='suffix': choose one of dflash, ngram, hybrid"):
        SpecEngine(t, tiny_drafter(t), kernels="torch", proposer="suffix")
    with pytest.raises(DFlashError, match="proposer=ngram: draft_cutoff"):
        SpecEngine(t, tiny_drafter(t), kernels="torch", proposer="ngram", draft_cutoff=0.3)
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    cfg = dataclasses.replace(
        cfg,
        architectures=["DFlash2DraftModel"],
        family_fields={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3},
    )
    with pytest.raises(DFlashError, match="proposer=hybrid: DFlash 2 drafters give no per-draft probability") as e:
        SpecEngine(t, DFlashDrafter(cfg).bind(t), kernels="torch", proposer="hybrid")
    assert "\n" not in str(e.value)
