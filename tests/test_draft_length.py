"""Confidence-gated draft length (decoding/draft_length.py): which drafts get verified, and that gating
never changes what is emitted (greedy == baseline; sampled output ~ the target's distribution)."""

import pytest
import torch
from conftest import OracleDrafter, tiny_drafter, tiny_target
from test_loop import PROMPTS, assert_follows_target

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.draft_length import draft_lengths
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import DFlashError


def test_draft_lengths_by_hand():
    conf = torch.tensor(
        [
            [0.9, 0.5, 0.9],  # running product 0.9, 0.45, 0.405
            [0.05, 1.0, 1.0],  # 0.05 ...: nothing sure
            [1.0, 1.0, 1.0],
        ]
    )
    assert draft_lengths(conf, 0.0).tolist() == [3, 3, 3]
    assert draft_lengths(conf, 0.4).tolist() == [3, 0, 3]
    assert draft_lengths(conf, 0.42).tolist() == [2, 0, 3]
    assert draft_lengths(conf, 0.9).tolist() == [1, 0, 3]
    # a confident draft after an unsure one does not count: the run is a prefix
    assert draft_lengths(torch.tensor([[0.3, 1.0, 0.99]]), 0.5).tolist() == [0]


class SureOracle(OracleDrafter):
    """OracleDrafter whose first sure[row] drafts are confident (probability ~1) and the rest,
    though still the target's tokens, unsure (probability ~0.01 over 256 tokens)."""

    def __init__(self, target, sequences, block_size, sure):
        super().__init__(target, sequences, block_size)
        self._sure = {tuple(s): k for s, k in zip(sequences, sure)}

    def draft_logits(self, block_ids, cache):
        logits = super().draft_logits(block_ids, cache)  # one-hot at the right token
        for r in range(logits.shape[0]):
            k = self._sure[tuple(cache.seqs[r])]
            logits[r, :k] *= 30.0
        return logits


@pytest.mark.parametrize("sure", [[0], [2], [15], [0, 3, 15]])
def test_gating_verifies_exactly_the_sure_drafts(sure):
    """Every draft is right, so each step accepts exactly what it verifies: a row sure of k drafts
    emits k + 1 tokens per step; drafts beyond k are never accepted even when another row of the
    batch verifies further (the verify width is the batch's longest)."""
    B, n_steps = 16, 3
    t = tiny_target("qwen3")
    prompts = PROMPTS[3][: len(sure)]
    tokens = [(max(sure) + 1) * n_steps] * len(sure)
    eng_params = SamplingParams(max_new_tokens=1 + max(tokens), ignore_eos=True)
    base = generate_baseline(t, prompts, eng_params)
    d = SureOracle(t, [p + toks for p, toks in zip(prompts, base.tokens)], B, sure)
    eng = SpecEngine(t, d, max_batch=len(prompts), max_seq_len=128, draft_cutoff=0.5)
    eng.add_requests([(str(r), p, eng_params) for r, p in enumerate(prompts)])
    got, stats = {str(r): [] for r in range(len(prompts))}, {}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            stats[o.request_id] = o.stats
    for r, k in enumerate(sure):
        s = stats[str(r)]
        assert got[str(r)] == base.tokens[r]
        assert s.num_accepted_draft_tokens == s.num_draft_tokens  # every verified draft was right ...
        full = s.num_verify_steps - 1  # ... and all but the last step (cut by max_new_tokens) verified k
        assert s.accept_hist[k + 1] >= full and s.num_draft_tokens >= k * full


@pytest.mark.parametrize("cutoff", [0.05, 0.5])
@pytest.mark.parametrize("batch", [1, 3])
def test_gated_greedy_equals_baseline(family, cutoff, batch):
    t = tiny_target(family)
    d = tiny_drafter(t, block_size=8, scale=4.0)  # peaky random drafter: confidence varies by step
    prompts = PROMPTS[batch]
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    out = generate(t, d, prompts, params, draft_cutoff=cutoff)
    assert out.tokens == generate_baseline(t, prompts, params).tokens
    s = out.stats
    assert s.num_draft_tokens < s.num_verify_steps * 7  # some steps verified fewer than B-1 drafts


def test_gated_greedy_rows_exact_inside_sampled_batch():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4, scale=4.0)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = generate_baseline(t, [[7, 8, 9]], greedy).tokens[0]
    eng = SpecEngine(t, d, max_batch=2, max_seq_len=64, draft_cutoff=0.2)
    eng.add_request("s", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, ignore_eos=True))
    eng.add_request("g", [7, 8, 9], greedy)
    got = []
    while eng.has_unfinished():
        got += [tok for o in eng.step() if o.request_id == "g" for tok in o.new_token_ids]
    assert got == ref


def test_gated_sampling_keeps_the_target_distribution():
    """As test_loop's chi-square test, with the draft length chosen per row by the drafter's q."""
    V, N, prompt = 12, 3000, [3, 1, 4]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    d = tiny_drafter(t, block_size=4, scale=3.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    out = generate(t, d, [prompt] * N, params, draft_cutoff=0.3)
    s = out.stats
    assert 0.05 < s.acceptance_rate < 0.95, s.acceptance_rate
    assert s.num_draft_tokens < 3 * s.num_verify_steps  # lengths really varied
    assert_follows_target(t, prompt, V, out.tokens)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2])
def test_bad_cutoff_is_refused(bad):
    t = tiny_target("qwen3")
    with pytest.raises(DFlashError, match="draft_cutoff"):
        SpecEngine(t, tiny_drafter(t), max_batch=1, draft_cutoff=bad)
