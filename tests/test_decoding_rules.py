"""The rules with one home each: statistics (decoding/stats.py), the stop/length rule
(decoding/stopping.py) and prompt validation (decoding/prompt.py), pinned by hand-computed cases
and checked through every entry point that uses them."""

from __future__ import annotations

import re
import threading

import pytest
from conftest import tiny_drafter, tiny_target

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.prompt import check_prompt
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.decoding.stopping import StopRule
from dflash_trt.errors import DFlashError
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import Progress, Sampling, TokenRequest


# ---- statistics --------------------------------------------------------------------------------
def test_tau_and_acceptance_on_a_hand_computed_case():
    s = DecodeStats(block_size=4)
    for accepted, drafted in ((3, 3), (0, 3), (1, 2), (0, 0)):  # the last: a step that verified no drafts
        s.record(accepted, drafted)
    # tokens per step, bonus included: 4, 1, 2, 1 -> tau 8 / 4
    assert s.tau == 2.0
    assert s.acceptance_rate == 4 / 8 and s.drafts_per_step == 2.0
    assert s.accept_hist == [0, 2, 1, 0, 1]  # [k] = steps that gave k tokens
    assert s.accepted_at == [2, 1, 1] and s.per_position_acceptance == [0.5, 0.25, 0.25]
    # the same counts seen only as a histogram (the bench's HF methods), and over the wire (serving)
    h = DecodeStats.from_hist(s.accept_hist, s.num_draft_tokens)
    assert (h.tau, h.per_position_acceptance, h.drafts_per_step) == (2.0, [0.5, 0.25, 0.25], 2.0)
    p = Progress([], 0, "", 0, s.num_draft_tokens, s.num_accepted_draft_tokens, s.num_verify_steps)
    assert (p.acceptance_length, p.acceptance_rate) == (2.0, 0.5)


def test_tau_of_plain_decoding_is_one_and_of_no_step_zero():
    assert DecodeStats(num_verify_steps=5).tau == 1.0  # baseline: one token per target pass
    assert DecodeStats(block_size=4).tau == 0.0 and DecodeStats().per_position_acceptance == []


def test_record_refuses_an_impossible_step():
    s = DecodeStats(block_size=4)
    with pytest.raises(DFlashError, match="accepted=4, drafted=4"):
        s.record(4, 4)  # at most B-1 drafts per step
    with pytest.raises(DFlashError, match="block_size=-1"):
        DecodeStats(block_size=-1)


def test_per_request_stats_add_up_to_the_batch_stats():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5], [200]]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    eng = SpecEngine(t, d, max_batch=3, max_seq_len=len(prompts[1]) + params.max_new_tokens + 1)
    eng.add_requests([(str(r), p, params) for r, p in enumerate(prompts)])
    per_req = {}
    while eng.has_unfinished():
        per_req.update({o.request_id: o.stats for o in eng.step() if o.finished})
    batch = generate(t, d, prompts, params).stats
    reqs = list(per_req.values())
    assert len(reqs) == 3
    for k in (
        "num_prompt_tokens",
        "num_output_tokens",
        "num_verify_steps",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
    ):
        assert getattr(batch, k) == sum(getattr(s, k) for s in reqs), k
    assert batch.accept_hist == [sum(col) for col in zip(*(s.accept_hist for s in reqs))]
    assert batch.accepted_at == [sum(col) for col in zip(*(s.accepted_at for s in reqs))]
    steps = [s.num_verify_steps for s in reqs]
    assert batch.tau == pytest.approx(sum(s.tau * n for s, n in zip(reqs, steps)) / sum(steps))  # step-weighted
    assert sum(batch.accept_hist) == batch.num_verify_steps and batch.block_size == 4


# ---- stop / length rule ------------------------------------------------------------------------
def test_stop_rule_cuts_after_the_first_ending_token():
    rule = StopRule(frozenset({7}), max_new_tokens=5, num_prompt=3, max_len=100)
    assert rule.admit(0, [1, 7, 2]) == (2, "stop")  # the stop token is kept, what follows dropped
    assert rule.admit(2, [1, 2, 3, 4]) == (3, "length")  # 2 + 3 = max_new_tokens
    assert rule.admit(0, [1, 2]) == (2, None)
    assert rule.admit(4, [7]) == (1, "stop")  # stop wins over length on the same token
    ctx = StopRule(frozenset(), max_new_tokens=50, num_prompt=8, max_len=10)
    assert ctx.admit(0, [1, 2, 3]) == (2, "length")  # prompt + output may not pass max_len


def test_stop_rule_for_request_adds_eos_unless_ignored():
    eos = frozenset({0})
    assert StopRule.for_request(SamplingParams(stop_token_ids=(3,)), eos, 1, 10).stops == {0, 3}
    assert StopRule.for_request(SamplingParams(stop_token_ids=(3,), ignore_eos=True), eos, 1, 10).stops == {3}


@pytest.mark.parametrize("max_new", [1, 2, 5, 6])
def test_engine_and_baseline_stop_at_the_same_token(max_new):
    """A verify step can accept past the token budget: both loops must emit exactly max_new
    tokens, and at a stop token both must end on it."""
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    prompts = [[5, 17, 42], [200]]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    base, spec = generate_baseline(t, prompts, params), generate(t, d, prompts, params)
    assert [len(x) for x in base.tokens] == [len(x) for x in spec.tokens] == [max_new, max_new]
    assert base.tokens == spec.tokens and base.finish_reasons == spec.finish_reasons == ["length"] * 2
    stop = base.tokens[0][max_new - 1]
    stopped = SamplingParams(max_new_tokens=max_new + 4, stop_token_ids=(stop,))
    a, b = generate_baseline(t, prompts[:1], stopped), generate(t, d, prompts[:1], stopped)
    cut = base.tokens[0].index(stop) + 1
    assert a.tokens == b.tokens == [base.tokens[0][:cut]] and a.finish_reasons == b.finish_reasons == ["stop"]


# ---- greedy threshold (SamplingParams.greedy) ---------------------------------------------------
@pytest.mark.parametrize("temp", [1e-38, 1e-7, 0.999e-5])
def test_tiny_temperature_decodes_greedily_everywhere(temp):
    """A temperature below SamplingParams.GREEDY_TEMPERATURE is greedy: dividing logits by 1e-38
    overflowed to NaN and the output was garbage (issue #30 item 4)."""
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    prompt = [[5, 17, 42], [3, 8]]
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    tiny = SamplingParams(temperature=temp, max_new_tokens=16, ignore_eos=True, seed=3)
    assert tiny.greedy and not SamplingParams(temperature=SamplingParams.GREEDY_TEMPERATURE).greedy
    ref = generate_baseline(t, prompt, greedy).tokens
    assert generate(t, d, prompt, tiny).tokens == ref
    assert generate_baseline(t, prompt, tiny).tokens == ref
    eng = SpecEngine(t, d, max_batch=2, max_seq_len=64)
    eng.add_request("a", prompt[0], tiny)
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got == ref[0]


@pytest.mark.parametrize("temp", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_temperature_is_refused_in_one_line(temp):
    with pytest.raises(DFlashError, match=r"^temperature=.*: must be a finite number >= 0 \(below 1e-05 is greedy\)$"):
        SamplingParams(temperature=temp)


# ---- prompt validation -------------------------------------------------------------------------
BAD = [
    ([], "empty"),
    ([1, 256], r"token ids \[256\] outside the vocabulary 0..255"),
    ([-1], "outside the vocabulary"),
    (list(range(16)), "prompt has 16 tokens but the context is max_seq_len=16"),
]


@pytest.mark.parametrize("ids,msg", BAD)
def test_check_prompt_refusals_name_the_field(ids, msg):
    with pytest.raises(DFlashError, match=msg) as e:
        check_prompt(ids, 256, 16, "input_ids")
    assert str(e.value).startswith("input_ids: ") and "\n" not in str(e.value)
    check_prompt(list(range(15)), 256, 16)  # one below the context: accepted
    with pytest.raises(DFlashError, match="^text_input: prompt has 16 tokens"):
        check_prompt(list(range(16)), 256, 16, "input_ids", length_field="text_input")


@pytest.fixture(scope="module")
def small_engine_pair():
    t = tiny_target("qwen3")
    return t, tiny_drafter(t, block_size=4)


@pytest.mark.parametrize("ids,msg", BAD)
def test_engine_refuses_bad_prompts(small_engine_pair, ids, msg):
    t, d = small_engine_pair
    eng = SpecEngine(t, d, max_batch=2, max_seq_len=16)
    with pytest.raises(DFlashError, match=msg) as e:
        eng.add_request("r", ids, SamplingParams())
    assert str(e.value).startswith("prompt_ids: ") and not eng.has_unfinished()


class _Sink:
    def __init__(self):
        self.errors, self.done = [], threading.Event()

    def is_cancelled(self):
        return False

    def send(self, progress, final):
        self.done.set()

    def error(self, message):
        self.errors.append(message)
        self.done.set()

    def close(self):
        self.done.set()


@pytest.mark.parametrize("ids,msg", BAD)
def test_orchestrator_refuses_bad_prompts_at_submit(small_engine_pair, ids, msg):
    """Refused in submit() itself, before anything queues (the step loop is never started)."""
    t, d = small_engine_pair
    orch = Orchestrator(lambda: SpecEngine(t, d, max_batch=2, max_seq_len=16))
    sink = _Sink()
    orch.submit(TokenRequest(ids, Sampling(max_tokens=3)), sink)
    field = "text_input" if "max_seq_len" in msg else "input_ids"  # text clients' prompts are too long as text
    assert len(sink.errors) == 1 and sink.errors[0].startswith(f"{field}: ")
    assert re.search(msg, sink.errors[0]) and not orch._waiting  # nothing queued
