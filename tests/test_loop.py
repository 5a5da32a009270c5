"""The loop's invariants: lossless greedy, oracle drafter accepts all, sampled output ~ target."""

import pytest
import torch
from conftest import OracleDrafter, tiny_drafter, tiny_target
from test_verify import chi2_pvalue

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline

PROMPTS = {1: [[5, 17, 42, 99, 3, 250, 7]], 3: [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [200]]}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("B", [2, 4, 16])
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_greedy_dflash_equals_greedy_baseline(family, batch, B, kind):
    t = tiny_target(family)
    prompts = PROMPTS[batch]
    params = SamplingParams(max_new_tokens=1 + 3 * B, ignore_eos=True)
    base = generate_baseline(t, prompts, params)
    if kind == "random":
        d = tiny_drafter(t, block_size=B)
    else:
        d = OracleDrafter(t, [p + toks for p, toks in zip(prompts, base.tokens)], B)
    out = generate(t, d, prompts, params)
    assert out.tokens == base.tokens
    assert all(len(x) == params.max_new_tokens for x in out.tokens)
    s = out.stats
    assert s.num_output_tokens == batch * params.max_new_tokens
    assert sum(s.accept_hist) == s.num_verify_steps
    if kind == "oracle":
        assert s.tau == B  # every draft accepted, every step full
        assert s.per_position_acceptance == [1.0] * (B - 1)
    else:
        assert s.tau < 1.5  # random weights over 256 tokens: almost nothing accepted


def test_stop_token_ends_row_and_is_included():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    prompt = [[5, 17, 42]]
    ref = generate_baseline(t, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)).tokens[0]
    stop = ref[9]
    first = ref.index(stop)
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
    out = generate(t, d, prompt, params)
    assert out.tokens[0] == ref[: first + 1] and out.finish_reasons == ["stop"]
    assert generate_baseline(t, prompt, params).tokens[0] == ref[: first + 1]


def test_baseline_rows_leaving_the_batch_match_rows_run_alone():
    """generate_baseline drops finished rows from the batch; the others must not notice (greedy and
    seeded sampling: row r's generator is seeded seed + r whatever happens to its neighbours)."""
    t = tiny_target("qwen3")
    prompts = PROMPTS[3]  # 3, 11 and 1 tokens: with max_seq_len 25 the rows hit the cap at different steps
    solo = generate_baseline(t, prompts[0:1], SamplingParams(max_new_tokens=30, ignore_eos=True)).tokens[0]
    for temp, stops in ((0.0, (solo[6],)), (0.9, ())):
        p = SamplingParams(temperature=temp, max_new_tokens=30, stop_token_ids=stops, seed=5, ignore_eos=True)
        out = generate_baseline(t, prompts, p, max_seq_len=25)
        assert len({len(x) for x in out.tokens}) == 3, "the test needs rows that leave at different steps"
        for r, prompt in enumerate(prompts):
            alone = generate_baseline(t, [prompt], SamplingParams(**{**p.__dict__, "seed": p.seed + r}), max_seq_len=25)
            assert out.tokens[r] == alone.tokens[0] and out.finish_reasons[r] == alone.finish_reasons[0]


def test_continuous_batching_join_and_cancel():
    t = tiny_target("llama")
    d = tiny_drafter(t, block_size=4)
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    a, b, c = [1, 2, 3, 4], [9, 10], [30, 31, 32, 33, 34, 35]
    ref = generate_baseline(t, [a, b], p).tokens
    eng = SpecEngine(t, d, max_batch=4, max_seq_len=64)
    got = {"a": [], "b": [], "c": []}
    done = {}
    eng.add_request("a", a, p)
    eng.add_request("c", c, p)
    for _ in range(2):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    eng.add_request("b", b, p)  # joins a running batch
    eng.cancel("c")
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert got["a"] == ref[0] and got["b"] == ref[1]
    assert done == {"a": "length", "b": "length", "c": "cancelled"}


def test_engine_rejects_bad_requests():
    t = tiny_target("qwen3")
    eng = SpecEngine(t, tiny_drafter(t), max_batch=2, max_seq_len=16)
    with pytest.raises(Exception, match="max_seq_len=16"):
        eng.add_request("x", list(range(20)), SamplingParams())
    with pytest.raises(Exception, match="empty"):
        eng.add_request("y", [], SamplingParams())
    with pytest.raises(Exception, match="vocabulary"):
        eng.add_request("z", [1, 99999], SamplingParams())
    assert not eng.has_unfinished()


def test_context_limit_finishes_with_length():
    t = tiny_target("qwen3")
    eng = SpecEngine(t, tiny_drafter(t, block_size=4), max_batch=1, max_seq_len=12)
    eng.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=100, ignore_eos=True))
    toks, reason = [], None
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            reason = o.finish_reason or reason
    assert len(toks) == 7 and reason == "length"


def test_seeded_sampling_is_deterministic():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    p = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=123, ignore_eos=True)
    a = generate(t, d, [[1, 2, 3], [4, 5]], p).tokens
    b = generate(t, d, [[1, 2, 3], [4, 5]], p).tokens
    c = generate(t, d, [[1, 2, 3], [4, 5]], SamplingParams(**{**p.__dict__, "seed": 7})).tokens
    assert a == b and a != c


def test_greedy_rows_exact_inside_sampled_batch():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = generate_baseline(t, [[7, 8, 9]], greedy).tokens[0]
    eng = SpecEngine(t, d, max_batch=3, max_seq_len=64)
    eng.add_request("s1", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, ignore_eos=True))
    eng.add_request("g", [7, 8, 9], greedy)
    eng.add_request("s2", [3], SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12, seed=2, ignore_eos=True))
    got = []
    while eng.has_unfinished():
        got += [tok for o in eng.step() if o.request_id == "g" for tok in o.new_token_ids]
    assert got == ref


def _exact_marginals(t, prompt, V):
    """P(token 2) and P(token 3) of the target's own sampling at temperature 1, by enumeration."""
    hf = t.hf
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1).double()  # [V]
        ids = torch.tensor([prompt + [a] for a in range(V)])
        p2 = hf(ids).logits[:, -1].softmax(-1).double()  # [V(t1), V(t2)]
        ids3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = hf(ids3).logits[:, -1].softmax(-1).double().view(V, V, V)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def assert_follows_target(t, prompt: list[int], V: int, outputs: list[list[int]]) -> None:
    """Tokens 2 and 3 of every output (rows sampled from `prompt`) follow the target's own distribution:
    chi-square over the cells expected more than 5 times (the test needs populated cells), p > 1e-3."""
    N = len(outputs)
    for col, exp in zip((1, 2), _exact_marginals(t, prompt, V)):
        got = torch.bincount(torch.tensor([x[col] for x in outputs]), minlength=V).numpy()
        keep = exp * N > 5
        assert chi2_pvalue(got[keep.numpy()], exp[keep]) > 1e-3


def test_sampled_output_distribution_equals_target():
    """Speculative sampling is lossless: tokens 2 and 3 (drafted, verified, resampled) follow the
    target's own distribution. Chi-square at a fixed seed over N independent rows."""
    V, N, prompt = 12, 3000, [3, 1, 4]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        for m in (t.lm_head,):
            m.weight.mul_(8.0)  # peakier target: a non-trivial distribution to match
    d = tiny_drafter(t, block_size=4, scale=3.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    out = generate(t, d, [prompt] * N, params)
    s = out.stats
    assert 0.05 < s.acceptance_rate < 0.95, s.acceptance_rate  # both accept and reject paths exercised
    assert_follows_target(t, prompt, V, out.tokens)
