"""Cost-aware draft length (decoding/verify_cost.py, draft_length="cost"): the width choice against a
hand computation, the curve's interpolation and measurement, greedy output equal to the target's for
every proposer, sampled output following the target (chi-square), and the two extremes of the cost
curve (flat: whole blocks; steep: short runs)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from test_loop import assert_follows_target

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.decoding.verify_cost import VerifyCost, best_width
from dflash_trt.errors import ConfigError

FLAT = VerifyCost([1, 4096], [1.0, 1.0])  # a GPU: any width costs one step
STEEP = VerifyCost([1, 2], [1.0, 2.0])  # cost proportional to the tokens scored


def run(t, d, prompts, params, **kw):
    eng = SpecEngine(
        t,
        d,
        max_batch=len(prompts),
        max_seq_len=80,
        kernels="torch",
        draft_length="cost",
        **{"proposer": "dflash", **kw},
    )
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    out = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))], eng


def test_best_width_hand_computed():
    surv = torch.tensor([[0.9, 0.5, 0.1]])  # expected tokens by width: 1, 1.9, 2.4, 2.5
    caps = torch.tensor([3])
    assert best_width(surv, caps, FLAT, 0.0) == 4  # tokens / 1.0: the most tokens
    assert best_width(surv, caps, STEEP, 0.0) == 1  # 1/1 > 1.9/2 > 2.4/3 > 2.5/4
    assert best_width(surv, caps, STEEP, 2.0) == 3  # with 2 s of drafting: 1/3, 1.9/4, 2.4/5, 2.5/6
    assert best_width(surv, torch.tensor([1]), FLAT, 0.0) == 2  # a row offering one draft: nothing past it


def test_curve_interpolates_and_is_measured():
    c = VerifyCost([1, 4, 8], [1.0, 2.0, 4.0])
    assert c(1) == 1.0 and c(2) == pytest.approx(4 / 3) and c(6) == 3.0 and c(12) == 6.0
    t = tiny_target("qwen3")
    m = VerifyCost.measure(t, 12, [1], reps=1)
    assert m.tokens == [1, 2, 4, 8, 12] and all(s > 0 for s in m.seconds)


@pytest.mark.parametrize("proposer", ["dflash", "ngram", "hybrid"])
def test_greedy_equals_target_at_both_extremes(proposer):
    t = tiny_target("qwen3", vocab_size=12)
    with torch.no_grad():
        t.lm_head.weight.mul_(6.0)  # loops: copied drafts get accepted too
    d = tiny_drafter(t, block_size=4)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    base = generate_baseline(t, prompts, params).tokens
    flat, eng_flat = run(t, d, prompts, params, proposer=proposer, verify_cost=FLAT)
    steep, eng_steep = run(t, d, prompts, params, proposer=proposer, verify_cost=STEEP)
    assert flat == base and steep == base


def test_flat_curve_verifies_whole_blocks_and_steep_curve_short_runs():
    """Per drafting round: the whole block on a flat curve, short runs on a steep one (an untrained
    drafter is also skipped on most rounds, see the next test: only its rounds are compared here)."""
    t = tiny_target("qwen3")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    widths = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        d = tiny_drafter(t, block_size=4)  # untrained: unsure of every draft
        eng = SpecEngine(
            t,
            d,
            max_batch=1,
            max_seq_len=64,
            kernels="torch",
            draft_length="cost",
            verify_cost=curve,
            proposer="dflash",
        )
        eng.add_request("a", [1, 2, 3], params)
        while eng.has_unfinished():
            eng.step()
        rec = eng.session.record("dflash")
        widths[name] = rec.drafted
    assert widths["flat"] == pytest.approx(3.0) and widths["steep"] < 1.0, widths


def test_sampled_output_follows_target():
    V, N, prompt = 12, 3000, [3, 1, 4]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    d = tiny_drafter(t, block_size=4, scale=3.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    mid = VerifyCost([N, 2 * N, 3 * N, 4 * N], [1.0, 1.0, 2.5, 4.0])  # the 2nd token is free, the rest costly
    eng = SpecEngine(
        t, d, max_batch=N, max_seq_len=16, kernels="torch", draft_length="cost", verify_cost=mid, proposer="dflash"
    )
    for i in range(N):
        eng.add_request(str(i), prompt, SamplingParams(**{**params.__dict__, "seed": 1000 + i}))
    out, drafted, steps = {}, 0, 0
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                drafted, steps = drafted + o.stats.num_draft_tokens, steps + o.stats.num_verify_steps
    assert 0 < drafted < 3 * steps  # the width was cut, and not to nothing
    assert_follows_target(t, prompt, V, [out[str(i)] for i in range(N)])


def test_cost_takes_no_cutoff():
    t = tiny_target("qwen3")
    with pytest.raises(ConfigError, match="draft_length=cost chooses how many drafts") as e:
        SpecEngine(t, tiny_drafter(t), kernels="torch", draft_length="cost", draft_cutoff=0.3)
    assert "\n" not in str(e.value)


def test_a_drafter_that_does_not_pay_is_skipped_and_probed():
    """draft_length=cost on a steep curve with an untrained drafter: after it fails to pay, rounds run
    without it (plain steps), with a probe every PROBE_EVERY rounds; output stays the target's."""
    from dflash_trt.decoding.verify_cost import PROBE_EVERY

    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    got, eng = run(t, d, [[1, 2, 3]], params, verify_cost=VerifyCost([1, 2], [1.0, 2.0]))
    assert got == generate_baseline(t, [[1, 2, 3]], params).tokens
    rounds = eng.session.record("dflash").rounds
    assert 1 <= rounds <= 40 // PROBE_EVERY + 2, rounds  # the drafter ran on probes only
