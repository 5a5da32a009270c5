"""The drafter's context queue (decoding/context_queue.py): features of rounds without the drafter wait and
are injected in one pass when it next runs. `append` against a per-row list reference; in the engine, after
every round, the drafter cache plus the queue hold exactly the K/V and features of the text so far (as one
injection over the whole text would write them), output stays the target's, and the queue really waits."""

from __future__ import annotations

import torch
from conftest import fp32_tol, tiny_drafter, tiny_target

from dflash_trt.config import SamplingParams
from dflash_trt.decoding import context_queue, verify_cost
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.decoding.verify_cost import VerifyCost

STEEP = VerifyCost([1, 2], [1.0, 2.0])  # verify cost proportional to tokens: an untrained drafter never pays


def test_append_equals_per_row_concatenation():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        R, P, W, F = 3, int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g)), 5
        pending, taps = torch.randn(R, P, F, generator=g), torch.randn(R, W, F, generator=g)
        pn, nn = torch.randint(0, P + 1, (R,), generator=g), torch.randint(1, W + 1, (R,), generator=g)
        out, n = context_queue.append(pending, pn, taps, nn, min_width=4)
        assert n.tolist() == (pn + nn).tolist() and out.shape[1] >= max(4, int(n.max()))
        for r in range(R):
            want = torch.cat([pending[r, : pn[r]], taps[r, : nn[r]]])
            torch.testing.assert_close(out[r, : n[r]], want, atol=0, rtol=0)


def _check_context(eng: SpecEngine, t, d, inject, prompts) -> None:
    """Row by row: drafter cache length + queued == target cache length; the drafter's K/V equal one
    injection of the text's features; the queue holds the features that follow."""
    for r, req in enumerate(eng.reqs):
        text = prompts[int(req.request_id)] + req.output[:-1]  # the target cache holds all but `last`
        n, k = int(eng.tcache.lengths[r]), int(eng.pending_n[r])
        m = int(eng.dcache.lengths[r])
        assert n == len(text) and m + k == n, (n, m, k)
        ref = t.forward(torch.tensor([text]), t.new_cache(1, 128), eng.tap_layers).taps  # [1, n, F]
        torch.testing.assert_close(eng.pending[r, :k], ref[0, m:n], **fp32_tol(ref[0, m:n]))
        c = d.new_cache(1, 128)
        inject(ref[:, :m], torch.tensor([m]), c)  # the drafter's own, unwatched
        for layer in range(len(c.k)):
            torch.testing.assert_close(
                eng.dcache.k[layer][r, :, :m], c.k[layer][0, :, :m], **fp32_tol(c.k[layer][0, :, :m])
            )
            torch.testing.assert_close(
                eng.dcache.v[layer][r, :, :m], c.v[layer][0, :, :m], **fp32_tol(c.v[layer][0, :, :m])
            )


def test_engine_queue_waits_and_context_stays_whole(monkeypatch):
    """hybrid + draft_length=cost on a steep curve: the untrained drafter is skipped on most rounds, so the
    queue grows across rounds (and is injected when full or when the drafter is probed); a request joins
    while features wait. After every round the context is exact and the output is the target's."""
    t = tiny_target("qwen3", vocab_size=12)
    with torch.no_grad():
        t.lm_head.weight.mul_(6.0)  # peaky: the greedy text loops, so copies exist
    d = tiny_drafter(t, block_size=4)
    injected, real = [], d.inject_context
    monkeypatch.setattr(d, "inject_context", lambda *a: injected.append(int(a[0].shape[1])) or real(*a))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eng = SpecEngine(
        t, d, max_batch=3, max_seq_len=100, kernels="torch", draft_length="cost", proposer="hybrid", verify_cost=STEEP
    )
    eng.add_requests([("0", prompts[0], params), ("1", prompts[1], params)])
    out, rounds, waited = {"0": [], "1": [], "2": []}, 0, 0
    while eng.has_unfinished():
        if rounds == 6:
            eng.add_request("2", prompts[2], params)
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        rounds += 1
        waited += eng.deferred
        if eng.reqs:
            _check_context(eng, t, d, real, prompts)
    assert [out[k] for k in "012"] == generate_baseline(t, prompts, params).tokens
    assert waited >= 3, waited  # features did wait across rounds
    assert max(injected) > d.block_size  # ... and went in together, more than one round's at once
    # the queue is bounded: it doubles from MIN_BLOCKS blocks while under MAX_BYTES
    F = eng.pending.shape[-1] if eng.pending is not None else 1
    bound = max(context_queue.MIN_BLOCKS * d.block_size, context_queue.MAX_BYTES // (3 * F * 4))
    assert max(injected) <= 2 * bound + d.block_size


def test_probes_back_off(monkeypatch):
    """A drafter that keeps not paying is tried every 8th round, then every 16th, 32nd, ... (PROBE_EVERY_MAX)."""
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block_size=4)
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    eng = SpecEngine(t, d, max_batch=1, max_seq_len=200, kernels="torch", draft_length="cost", verify_cost=STEEP)
    eng.add_request("0", [1, 2, 3], params)
    ran, n = [], 0
    while eng.has_unfinished():
        before = eng.session.record("dflash").rounds
        eng.step()
        ran.append(eng.session.record("dflash").rounds > before)
        n += 1
    runs = [i for i, x in enumerate(ran) if x]
    gaps = [b - a for a, b in zip(runs, runs[1:])]  # rounds from one try to the next
    assert gaps and gaps[0] == verify_cost.PROBE_EVERY, (runs, n)
    assert all(b == min(2 * a, verify_cost.PROBE_EVERY_MAX) for a, b in zip(gaps, gaps[1:])), gaps


def test_a_long_wait_fits_a_tight_cache(monkeypatch):
    """max_seq_len just above prompt + max_new_tokens, the drafter skipped from round 21 to 53 (the queue,
    which grows by doubling, is then 64 wide for 33 entries, written after 20 rounds of text) and run after:
    the queue still fits the drafter cache when injected, single row and batched, and the output is the
    target's."""
    t = tiny_target("qwen3", vocab_size=12)
    d = tiny_drafter(t, block_size=4)
    rounds = [0]

    def skip(self, record, rows):
        rounds[0] += 1
        return 20 < rounds[0] <= 53

    monkeypatch.setattr(verify_cost.PayGate, "skip", skip)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for prompts in ([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7, 8, 9, 10]]):
        rounds[0] = 0
        need = max(map(len, prompts)) + params.max_new_tokens
        eng = SpecEngine(
            t,
            d,
            max_batch=3,
            max_seq_len=need,
            kernels="torch",
            draft_length="cost",
            proposer="hybrid",
            verify_cost=STEEP,
        )
        eng.add_requests([(str(i), p, params) for i, p in enumerate(prompts)])
        out = {str(i): [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        assert [out[str(i)] for i in range(len(prompts))] == generate_baseline(t, prompts, params).tokens
