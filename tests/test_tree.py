"""proposer=tree (decoding/tree.py): the tree-masked target pass gives every node the logits and target
features of a chain verify of its branch, the cache compaction leaves what a chain verify of the kept
branch writes, greedy tree decoding equals target greedy with both branches winning rounds, the
statistics' invariants, sampled rows stay lossless (they choose, chi-square), and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import OracleDrafter, fp32_tol, tiny_drafter, tiny_target
from test_loop import assert_follows_target, chi2_pvalue

from dflash_trt.config import DrafterConfig, SamplingParams
from dflash_trt.decoding import tree
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.records import DrafterRecord
from dflash_trt.decoding.session import Session
from dflash_trt.decoding.verify import Verdict, two_branch_accept
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.drafter import DFlashDrafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 2, 3, 4, 5, 6, 7]]


def test_build_layout_dedupes_the_shared_prefix():
    block = torch.tensor([[7, 1, 2, 3, 4], [7, 5, 6, 8, 9]])
    t = tree.build(block, torch.tensor([4, 2]), [[1, 2, 9], []], pad_id=0)
    # row 0: x0, shared 1 2, copy tail 9, drafter tail 3 4; row 1: a chain (no copy), padded
    assert t.ids.tolist() == [[7, 1, 2, 9, 3, 4], [7, 5, 6, 0, 0, 0]]
    assert t.depth[0].tolist() == [0, 1, 2, 3, 3, 4]
    assert t.paths[0].tolist() == [[0, 1, 2, 4, 5], [0, 1, 2, 3, 0]]
    assert t.n_draft.tolist() == [[4, 3], [2, 0]] and t.shared == [2, 0] and t.copy_rows == [0]
    anc = t.ancestors[0].int().tolist()
    assert anc[3] == [1, 1, 1, 1, 0, 0] and anc[4] == [1, 1, 1, 0, 1, 0] and anc[5] == [1, 1, 1, 0, 1, 1]
    assert t.ancestors[1, 4].int().tolist() == [0, 0, 0, 0, 1, 0]  # padding sees only itself


def _random_trees(V: int, R: int, B: int, seed: int):
    """Per row a drafter block and a copy sharing a random-length prefix (some rows without a copy)."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(1, V, (R, B), generator=g)
    n_draft = torch.randint(1, B, (R,), generator=g)
    copies = []
    for r in range(R):
        if r == 1:
            copies.append([])
            continue
        m = int(torch.randint(0, int(n_draft[r]) + 1, (1,), generator=g))
        k = int(torch.randint(max(m, 1), B, (1,), generator=g))
        tail = torch.randint(1, V, (k - m,), generator=g).tolist()
        if m < n_draft[r] and tail and tail[0] == int(block[r, 1 + m]):
            tail[0] = tail[0] % (V - 1) + 1  # another token: the shared prefix is exactly m
        copies.append(block[r, 1 : 1 + m].tolist() + tail)
    return block, n_draft, copies


@pytest.mark.parametrize("fam", ["qwen3", "llama"])
def test_tree_nodes_equal_chain_verify_and_compaction_leaves_the_chain_cache(fam):
    t = tiny_target(fam)
    V, B, taps = t.vocab_size, 5, [0, 1]
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17]]  # ragged
    block, n_draft, copies = _random_trees(V, len(prompts), B, seed=4)
    tr = tree.build(block, n_draft, copies, pad_id=0)
    split = [0 < m < min(n) for m, n in zip(tr.shared, tr.n_draft.tolist())]  # a shared prefix, then two tails
    assert any(split) and tr.copy_rows == [0, 2, 3], (tr.shared, tr.n_draft)
    cache = t.new_cache(len(prompts), 32)
    t.prefill(prompts, cache, taps)
    start = cache.lengths.clone()
    out = t.forward(tr.ids, cache, taps, tree=(tr.depth, tr.ancestors))
    assert cache.lengths.tolist() == (start + tr.ids.shape[1]).tolist()
    keep = torch.tensor([1, 0, 1, 0])  # the branch each row keeps (row 1 has only the drafter's)
    for r, p in enumerate(prompts):
        for b in range(2):
            k = int(tr.n_draft[r, b]) + 1
            path = tr.paths[r, b, :k]
            c1 = t.new_cache(1, 32)
            t.prefill([p], c1, taps)
            chain = t.forward(tr.ids[r, path][None], c1, taps)
            torch.testing.assert_close(out.logits[r, path], chain.logits[0], **fp32_tol(chain.logits[0]))
            torch.testing.assert_close(out.taps[r, path], chain.taps[0], **fp32_tol(chain.taps[0]))
    # keep a whole branch per row, then compare K/V slot by slot with that row's chain cache
    path = torch.stack([tr.paths[r, int(keep[r])] for r in range(len(prompts))])  # [R, B]
    cache.gather_slots(start[:, None] + path, start)
    kept_len = torch.tensor([int(tr.n_draft[r, int(keep[r])]) + 1 for r in range(len(prompts))])
    cache.crop(start + kept_len)
    for r, p in enumerate(prompts):
        c1 = t.new_cache(1, 32)
        t.prefill([p], c1)
        t.forward(tr.ids[r, path[r, : int(kept_len[r])]][None], c1)
        n = int(cache.lengths[r])
        assert n == int(c1.lengths[0])
        for layer in range(t.num_layers):
            torch.testing.assert_close(
                cache.k[layer][r, :, :n], c1.k[layer][0, :, :n], **fp32_tol(c1.k[layer][0, :, :n])
            )
            torch.testing.assert_close(
                cache.v[layer][r, :, :n], c1.v[layer][0, :, :n], **fp32_tol(c1.v[layer][0, :, :n])
            )


def test_plain_forward_is_unchanged_by_an_explicit_chain_tree():
    """A chain given as a tree (depth = index, ancestors = lower triangle) is the default path's numbers."""
    t = tiny_target("qwen3")
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    c1, c2 = t.new_cache(2, 16), t.new_cache(2, 16)
    t.prefill([[1, 2, 3], [4]], c1)
    t.prefill([[1, 2, 3], [4]], c2)
    a = t.forward(ids, c1)
    chain = (torch.arange(5).repeat(2, 1), torch.ones(5, 5, dtype=torch.bool).tril().repeat(2, 1, 1))
    b = t.forward(ids, c2, tree=chain)
    assert torch.equal(a.logits, b.logits)
    with pytest.raises(DFlashError, match=r"tree: depth \(2, 4\)"):
        t.forward(ids, c2, tree=(chain[0][:, :4], chain[1]))


def test_pick_keeps_the_longer_branch_ties_to_the_drafter():
    main = Verdict(torch.tensor([2, 1, 3, 0]), torch.tensor([10, 11, 12, 13]))
    copy = Verdict(torch.tensor([3, 1, 5, 4]), torch.tensor([20, 21, 22, 23]))
    v, won = tree.pick(main, copy, torch.tensor([True, True, False, True]))
    assert won.tolist() == [True, False, False, True]
    assert v.accepted.tolist() == [3, 1, 3, 4] and v.bonus.tolist() == [20, 11, 12, 23]


class NoisyOracle(OracleDrafter):
    """Drafts the target's greedy text but gets every position p with p % 4 == 1 wrong: the drafter's
    block is accepted up to there, so a copy that is right for longer wins those rounds."""

    def draft_logits(self, block_ids, cache):
        logits = super().draft_logits(block_ids, cache)
        for r in range(block_ids.shape[0]):
            for i in range(logits.shape[1]):
                if (int(cache.lengths[r]) + 1 + i) % 4 == 1:
                    logits[r, i] = logits[r, i].roll(1)
        return logits * 8.0  # sure of itself: the drafter runs (it is not skipped for the copies)


def _looping(fam: str, V: int = 12):
    t = tiny_target(fam, vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(6.0)  # greedy text falls into short cycles: copies get accepted
    return t


@pytest.mark.parametrize("fam", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_tree_equals_target_greedy_and_both_branches_win(fam, rows, monkeypatch):
    t = _looping(fam)
    prompts = PROMPTS[:rows] if rows > 1 else [PROMPTS[1]]  # [9, 8, 7]: its copies are wrong at first
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = generate_baseline(t, prompts, params).tokens
    verdicts = []
    real_pick = tree.pick

    def spy(main, copy, has_copy):
        v, won = real_pick(main, copy, has_copy)
        verdicts.extend(zip(main.accepted[has_copy].tolist(), copy.accepted[has_copy].tolist()))
        return v, won

    monkeypatch.setattr(tree, "pick", spy)
    oracle = NoisyOracle(t, [p + x for p, x in zip(prompts, base)], block_size=6)
    # never skip the drafter for copies alone (proposers/hybrid.py copies_win): every round with a copy is a tree
    session = Session(records={"tree": DrafterRecord(rounds=1, accepted=99.0, decay=1.0)})
    out = generate(t, oracle, prompts, params, kernels="torch", proposer="tree", session=session)
    assert out.tokens == base
    assert any(c > m for m, c in verdicts) and any(m > c for m, c in verdicts), verdicts  # both branches win
    s = out.stats
    assert s.num_tree_steps == len(verdicts) and s.num_tree_copy_wins == sum(c > m for m, c in verdicts)
    assert s.num_tree_copy_wins <= s.num_copied_steps and s.num_tree_steps <= s.num_verify_steps
    src = s.sources
    assert src["drafter"]["steps"] + src["copied"]["steps"] == s.num_verify_steps
    assert src["drafter"]["accepted"] + src["copied"]["accepted"] == s.num_accepted_draft_tokens
    assert all(0 <= x["accepted"] <= x["drafts"] for x in src.values())
    assert sum(s.accept_hist) == s.num_verify_steps
    assert sum(len(x) for x in out.tokens) <= s.num_accepted_draft_tokens + s.num_verify_steps + rows


def test_greedy_tree_with_a_real_drafter_and_cutoff_stays_exact():
    t = _looping("qwen3")
    d = tiny_drafter(t, block_size=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    base = generate_baseline(t, PROMPTS, params).tokens
    assert generate(t, d, PROMPTS, params, kernels="torch", proposer="tree").tokens == base
    assert generate(t, d, PROMPTS, params, kernels="torch", proposer="tree", draft_cutoff=0.2).tokens == base


def test_two_branch_accept_is_lossless():
    """Recursive rejection over the drafter's sampled branch and a fixed copy: the first two emitted tokens
    follow the target's joint distribution (chi-square, 25 cells), with shared prefixes, both branches
    kept and rejections all occurring."""
    V, N = 5, 12000
    g = torch.Generator().manual_seed(0)
    table = {(): None}
    for a in range(V):
        table[(a,)] = None
        for b in range(V):
            table[(a, b)] = None
    for k in table:  # p(. | prefix): peaky enough that both accept and reject happen often
        table[k] = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    q = torch.tensor([[0.3, 0.3, 0.1, 0.1, 0.2], [0.2, 0.2, 0.4, 0.1, 0.1]])  # the drafter's, per position
    copy = [0, 2]  # the drafter samples 0 first with probability 0.3: shared prefixes are common
    counts = torch.zeros(V, V)
    seen = {"copy": 0, "drafter": 0, "shared": 0, "none": 0}
    for _ in range(N):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        p_d = torch.stack([table[()], table[tuple(d[:1])], table[tuple(d)]])
        p_c = torch.stack([table[()], table[tuple(copy[:1])], table[tuple(copy)]])
        u = torch.rand(5, generator=g)
        a, bonus, kept_copy = two_branch_accept(d, copy, p_d, p_c, q, u[:2], u[2:4], u[4:])
        toks = (copy if kept_copy else d)[:a] + [bonus]
        if len(toks) == 1:
            toks.append(int(torch.multinomial(table[tuple(toks)], 1, generator=g)))
        counts[toks[0], toks[1]] += 1
        seen["copy" if kept_copy and a else "drafter" if a else "none"] += 1
        seen["shared"] += int(d[0] == copy[0] and a >= 1)
    exact = torch.stack([table[()][a] * table[(a,)] for a in range(V)])  # [V, V]
    keep = (exact * N > 5).flatten()
    assert chi2_pvalue(counts.flatten()[keep].numpy(), exact.flatten()[keep]) > 1e-3
    assert min(seen.values()) > N // 50, seen


def test_sampled_tree_rows_follow_the_target():
    """Sampled rows verify the tree with two_branch_accept: tokens 2 and 3 follow the target (chi-square),
    with tree rounds that kept the copy and rounds that kept the drafter's block."""
    V, N, prompt = 12, 3000, [4, 2, 3, 4, 2]
    t = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        t.lm_head.weight.mul_(8.0)
    d = tiny_drafter(t, block_size=4, scale=3.0)
    session = Session(records={"tree": DrafterRecord(rounds=1, accepted=99.0, decay=1.0)})  # never skip the drafter
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000, ignore_eos=True)
    out = generate(t, d, [prompt] * N, params, kernels="torch", proposer="tree", session=session)
    s = out.stats
    assert s.num_tree_steps > N // 2 and 0 < s.num_tree_copy_wins < s.num_tree_steps, s
    assert_follows_target(t, prompt, V, out.tokens)


def test_refusals_are_one_line():
    t = tiny_target("qwen3")
    with pytest.raises(DFlashError, match="proposer=tree: draft_length=cost prices a chain verify") as e:
        SpecEngine(t, tiny_drafter(t), kernels="torch", proposer="tree", draft_length="cost")
    assert "\n" not in str(e.value)
    with pytest.raises(DFlashError, match="choose one of dflash, ngram, hybrid, tree"):
        SpecEngine(t, tiny_drafter(t), kernels="torch", proposer="trees")
    cfg = DrafterConfig.for_target(t.config, num_layers=1, block_size=4)
    cfg = dataclasses.replace(
        cfg,
        architectures=["DFlash2DraftModel"],
        family_fields={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3},
    )
    with pytest.raises(DFlashError, match="proposer=tree: DFlash 2 drafters give no per-draft probability"):
        SpecEngine(t, DFlashDrafter(cfg).bind(t), kernels="torch", proposer="tree")


def test_after_tree_rounds_cache_and_drafter_features_are_a_chain_verifys(monkeypatch):
    """After every tree round the target cache holds exactly the K/V of a plain forward over each row's
    text so far, and the features queued for the drafter are the kept branch's (those of that forward)."""
    t = _looping("llama")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = generate_baseline(t, PROMPTS, params).tokens
    eng = SpecEngine(t, NoisyOracle(t, [p + x for p, x in zip(PROMPTS, base)], 6), kernels="torch", proposer="tree")
    eng.add_requests([(str(i), p, params) for i, p in enumerate(PROMPTS)])
    rounds, real = [], tree.verify
    monkeypatch.setattr(tree, "verify", lambda *a: rounds.append(len(rounds)) or real(*a))
    checked = 0
    for _ in range(5):
        before = len(rounds)
        eng.step()
        if len(rounds) == before or len(eng.reqs) != 3:
            continue
        for r, req in enumerate(eng.reqs):
            text = PROMPTS[r] + req.output[:-1]  # the cache holds every verified token but the last
            n, k = len(text), int(eng.pending_n[r])
            assert int(eng.tcache.lengths[r]) == n
            c1 = t.new_cache(1, 64)
            ref = t.forward(torch.tensor([text]), c1, eng.tap_layers)
            torch.testing.assert_close(eng.pending[r, :k], ref.taps[0, n - k :], **fp32_tol(ref.taps[0, n - k :]))
            for layer in range(t.num_layers):
                torch.testing.assert_close(
                    eng.tcache.k[layer][r, :, :n], c1.k[layer][0, :, :n], **fp32_tol(c1.k[layer][0, :, :n])
                )
                torch.testing.assert_close(
                    eng.tcache.v[layer][r, :, :n], c1.v[layer][0, :, :n], **fp32_tol(c1.v[layer][0, :, :n])
                )
        checked += 1
    assert checked >= 2, checked


def test_penalised_and_mixed_batches_stay_exact(monkeypatch):
    """Logit controls apply along each branch as along a chain; in a batch with a sampled row, the greedy
    rows still decode exactly the target's greedy text (tree rounds included)."""
    t = _looping("qwen3")
    pen = SamplingParams(max_new_tokens=30, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7)
    ref = generate_baseline(t, PROMPTS, pen).tokens
    assert ref != generate_baseline(t, PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True)).tokens
    rounds, real = [], tree.verify
    monkeypatch.setattr(tree, "verify", lambda *a: rounds.append(1) or real(*a))
    oracle = NoisyOracle(t, [p + x for p, x in zip(PROMPTS, ref)], block_size=6)
    assert generate(t, oracle, PROMPTS, pen, kernels="torch", proposer="tree").tokens == ref
    assert rounds
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    base = generate_baseline(t, PROMPTS, greedy).tokens
    sampled = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3, ignore_eos=True)
    eng = SpecEngine(t, tiny_drafter(t, block_size=4), kernels="torch", proposer="tree")
    eng.add_requests([("0", PROMPTS[0], greedy), ("1", PROMPTS[1], sampled), ("2", PROMPTS[2], greedy)])
    out, rounds[:] = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [out["0"], out["2"]] == [base[0], base[2]] and len(out["1"]) == 30 and rounds
