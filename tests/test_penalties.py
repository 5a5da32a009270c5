"""Logit controls (repetition / presence / frequency penalties, min_tokens, bad words) stay lossless:
the verify block's penalised logits equal a slow per-position reference, speculative greedy equals the
penalised target's own token-by-token greedy decoding, and sampled output follows the penalised
target's distribution."""

from collections import Counter

import pytest
import torch
from conftest import OracleDrafter, tiny_drafter, tiny_target
from test_verify import chi2_pvalue

from dflash_trt.config import SamplingParams
from dflash_trt.decoding import penalties
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [200]]


def reference_penalised(raw: torch.Tensor, prompt, out, params: SamplingParams, stops) -> torch.Tensor:
    """The definitions of SamplingParams' docstring, token by token: the logits [V] that choose the token
    after prompt + out."""
    x = raw.float().clone()
    ctx = list(prompt) + list(out)
    for w in params.bad_words_ids:
        if w[-1] < len(x) and (
            len(w) == 1 or (len(ctx) >= len(w) - 1 and ctx[len(ctx) - len(w) + 1 :] == list(w[:-1]))
        ):
            x[w[-1]] = float("-inf")
    if len(out) < params.min_tokens:
        for s in stops:
            x[s] = float("-inf")
    for tok in set(ctx):
        v = x[tok]
        x[tok] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    for tok, c in Counter(out).items():
        x[tok] = x[tok] - params.frequency_penalty * c - params.presence_penalty
    return x


def reference_greedy(t, prompt, params: SamplingParams) -> list[int]:
    """The penalised target's own greedy decoding: one full forward per token, no cache, no drafts."""
    stops = set(params.stop_token_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < params.max_new_tokens:
            raw = t.hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference_penalised(raw, prompt, out, params, stops).argmax()))
            if out[-1] in stops:
                break
    return out


def _state(params, prompt, out, V, stops=()):
    s = penalties.state_for(params, frozenset(stops), prompt, V, "cpu")
    s.update(out)
    return s


def test_block_penalties_equal_per_position_reference():
    """Every position i of a block [R, W, V] is penalised as if drafts 1..i had been emitted (repeated
    drafts, drafts already in the output, a bad word spanning output and drafts, min_tokens' edge)."""
    V, W = 20, 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, W, V, generator=g) * 3
    prompts = [[1, 2, 3], [4, 4, 5], [6]]
    outs = [[7, 8, 7], [9], [3, 10, 11, 12]]
    drafts = torch.tensor([[7, 7, 2, 13, 7], [9, 1, 9, 1, 14], [12, 15, 15, 0, 3]])  # [R, W-1]
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3, bad_words_ids=((7, 2),)),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, min_tokens=4, bad_words_ids=((5,), (1, 9, 1))),
        SamplingParams(presence_penalty=-1.0, bad_words_ids=((12, 15, 15, 0),)),
    ]
    stops = [(), (14, 16), ()]
    states = [_state(p, pr, o, V, st) for p, pr, o, st in zip(params, prompts, outs, stops)]
    got = penalties.apply(logits, drafts, states)
    for r in range(3):
        for i in range(W):
            ctx_out = outs[r] + drafts[r, :i].tolist()
            want = reference_penalised(logits[r, i], prompts[r], ctx_out, params[r], stops[r])
            assert torch.equal(got[r, i].isinf(), want.isinf()), (r, i)
            torch.testing.assert_close(got[r, i], want, rtol=1e-6, atol=1e-6)
    assert got[0, :3, 2].isneginf().all() and got[0, 3, 2].isfinite()  # (7, 2): the context ends with 7 up to d_2
    assert got[1, 2, 14] == float("-inf") and got[1, 3, 14] > float("-inf")  # min_tokens=4 after 1 + 3 tokens


def test_rows_without_controls_are_untouched():
    logits = torch.randn(2, 3, 10)
    drafts = torch.randint(0, 10, (2, 2))
    assert penalties.apply(logits, drafts, [None, None]) is logits  # no work at all
    assert penalties.state_for(SamplingParams(), frozenset(), [1], 10, "cpu") is None
    on = _state(SamplingParams(repetition_penalty=2.0, min_tokens=1), [1, 2], [], 10, (3,))
    mixed = penalties.apply(logits, drafts, [None, on])
    assert torch.equal(mixed[0], logits[0]) and not torch.equal(mixed[1], logits[1])
    alone = penalties.apply(logits[1:], drafts[1:], [on])
    assert torch.equal(mixed[1], alone[0])  # a row's logits do not depend on its neighbours'


CONTROLS = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, bad_words_ids=((106,), (153, 104))),
]


@pytest.mark.parametrize("B", [2, 4])
@pytest.mark.parametrize("controls", CONTROLS)
def test_greedy_speculative_equals_penalised_target(family, B, controls):
    t = tiny_target(family)
    n = 1 + 4 * B  # the prefill's token, then full blocks: tau is exactly B when every draft passes
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, **controls)
    ref = [reference_greedy(t, p, params) for p in PROMPTS]
    plain = generate_baseline(t, PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True)).tokens
    assert ref != plain, "the controls must change the output for the test to mean anything"
    assert generate_baseline(t, PROMPTS, params).tokens == ref
    assert generate(t, tiny_drafter(t, block_size=B), PROMPTS, params).tokens == ref
    # a drafter proposing the penalised continuation has every draft accepted: each block position's
    # penalised logits are exactly those of token-by-token decoding
    oracle = OracleDrafter(t, [p + x for p, x in zip(PROMPTS, ref)], B)
    out = generate(t, oracle, PROMPTS, params, proposer="dflash")  # the drafter's every block
    assert out.tokens == ref and out.stats.tau == B


@pytest.mark.parametrize("proposer, cutoff", [("ngram", 0.0), ("hybrid", 0.0), ("dflash", 0.2)])
def test_greedy_with_other_proposers_and_lengths(proposer, cutoff):
    """Copied drafts (decoding/ngram.py, hybrid.py) and per-row draft lengths (masked past a row's
    length) are penalised the same way."""
    t = tiny_target("qwen3")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, **CONTROLS[2])
    ref = [reference_greedy(t, p, params) for p in PROMPTS]
    d = tiny_drafter(t, block_size=4)
    assert generate(t, d, PROMPTS, params, proposer=proposer, draft_cutoff=cutoff).tokens == ref


def test_min_tokens_holds_back_stop_tokens():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    free = generate_baseline(t, [PROMPTS[0]], SamplingParams(max_new_tokens=30, ignore_eos=True)).tokens[0]
    stop = free[2]  # the unconstrained run would stop at its 3rd token
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,), min_tokens=6)
    ref = reference_greedy(t, PROMPTS[0], params)
    assert stop not in ref[:6] and len(ref) > 6
    assert generate(t, d, [PROMPTS[0]], params).tokens[0] == ref
    assert generate_baseline(t, [PROMPTS[0]], params).tokens[0] == ref


def test_rows_with_different_controls_in_one_batch():
    """SpecEngine applies each row's own controls: every row equals its request decoded alone."""
    t = tiny_target("llama")
    eng = SpecEngine(t, tiny_drafter(t, block_size=4), max_batch=4, max_seq_len=64)
    reqs = {
        str(i): (p, SamplingParams(max_new_tokens=12, ignore_eos=True, **c))
        for i, (p, c) in enumerate(zip(PROMPTS + [[3, 3]], CONTROLS + [{}]))
    }
    for rid, (p, params) in reqs.items():
        eng.add_request(rid, p, params)
    got = {rid: [] for rid in reqs}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    for rid, (p, params) in reqs.items():
        assert got[rid] == reference_greedy(t, p, params), rid


def _penalised_marginals(t, prompt, params, V):
    """P(output token 2) and P(output token 3) of the penalised target's own sampling (T = 1), enumerated."""

    def dist(out):
        with torch.no_grad():
            raw = t.hf(torch.tensor([prompt + out])).logits[0, -1]
        return reference_penalised(raw, prompt, out, params, set(params.stop_token_ids)).softmax(-1).double()

    p1 = dist([])
    p2 = torch.stack([dist([a]) for a in range(V)])  # [V(t1), V(t2)]
    p3 = torch.stack([dist([a, b]) for a in range(V) for b in range(V)]).view(V, V, V)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def test_sampled_output_follows_penalised_target():
    """Rejection sampling against the penalised p (the drafter's q untouched) is lossless: output tokens
    2 and 3 follow the penalised target's own distribution (chi-square, fixed seed)."""
    V, N, prompt = 12, 3000, [3, 1, 4]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)  # peakier target: penalties move real mass
    d = tiny_drafter(t, block_size=4, scale=3.0)
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=3,
        seed=1000,
        stop_token_ids=(5,),
        min_tokens=3,
        repetition_penalty=1.5,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        bad_words_ids=((1, 7),),
    )
    out = generate(t, d, [prompt] * N, params)
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate  # accept and reject paths
    for col, exp in zip((1, 2), _penalised_marginals(t, prompt, params, V)):
        got = torch.bincount(torch.tensor([x[col] for x in out.tokens]), minlength=V).numpy()
        keep = exp * N > 5
        assert got[5] == 0  # min_tokens: the stop token is never drawn
        assert chi2_pvalue(got[keep.numpy()], exp[keep]) > 1e-3
    assert all(x[i : i + 2] != [1, 7] for x in out.tokens for i in range(2))


def test_seeded_sampling_with_controls_is_deterministic():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    p = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3, ignore_eos=True, repetition_penalty=1.4)
    a, b = (generate(t, d, PROMPTS, p).tokens for _ in range(2))
    c = generate(t, d, PROMPTS, SamplingParams(**{**p.__dict__, "seed": 4})).tokens
    assert a == b and a != c


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=9, max_new_tokens=8), "min_tokens"),
        (dict(bad_words_ids=((),)), "bad_words_ids"),
        (dict(bad_words_ids=(1, 2)), "bad_words_ids"),
    ],
)
def test_bad_controls_are_refused(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)
