"""proposer=tree: a row's two candidates, the drafter's block and the continuation copied from its own text
(decoding/ngram.py), verified together in ONE target pass as a token tree; the longer accepted branch is
kept, and only it stays in the target's KV cache.

Boundary: the tree's layout (`build`, called by the tree proposer, decoding/proposers/tree.py, which hands
the engine a Proposal carrying the Tree), its verification and branch choice (`verify`, `pick`, called by
the engine, which keeps the cache, the drafter's queue and the records' inputs). A round is a tree when some
row has a copy and the drafter ran; otherwise it is a plain chain verify, as for hybrid. The
tree-masked attention is modeling/target.py's `forward(tree=...)`, the slot compaction modeling/cache.py's
`gather_slots`, the sampled rows' two-branch rule decoding/verify.py's `two_branch_accept`.

Layout of a row (node 0 is the last verified token x0; the shared prefix is stored once):
    [x0, s_1..s_m, c_{m+1}..c_|c|, d_{m+1}..d_|d|]
s = the longest common prefix of the copy c and the drafter's drafts d. Node depth = its position in its
branch; a node sees the cache, itself and its ancestors only, so its logits (and target features) are
those a chain verify of its branch would give. Rows without a copy are plain chains.

Acceptance. Greedy rows: the existing greedy rule (decoding/verify.py) on each branch; each verdict is the
target's greedy continuation, so keeping either is exact; the longer is kept, ties go to the drafter's
branch (a greedy tie only happens when both stop inside the shared prefix or at its end, where the two
verdicts are identical). Sampled rows: taking the better of two independently judged branches would bias
the output, so they use recursive rejection sampling over the tree instead (verify.py two_branch_accept:
the drafter's candidate first, then the copy's against the residual), lossless, tested by chi-square.

Statistics: a tree round is one verify step of the kept branch (drafted = that branch's drafts, copied =
whether it was the copy), so tau and the per-source counts mean what they mean for a chain;
DecodeStats.num_tree_steps / num_tree_draft_tokens add the tree rounds and every draft they judged (shared
prefix once). For greedy rows both branches' verdicts feed the hybrid records (copy survival, the drafter's
record), which decide when the drafter is skipped for copies alone; sampled rows record the kept branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.decoding import penalties
from dflash_trt.decoding.ngram import NgramProposal
from dflash_trt.decoding.verify import Verdict, accept_rows, two_branch_accept, warp_logits


@dataclass
class Tree:
    ids: torch.Tensor  # [R, n] node tokens (node 0: the last verified token)
    depth: torch.Tensor  # [R, n] depth of each node (its RoPE offset from the cache length)
    ancestors: torch.Tensor  # [R, n, n] bool, [r, j, i]: node i is node j or one of its ancestors
    paths: torch.Tensor  # [R, 2, B] nodes of branch 0 (drafter's) / 1 (copy) at chain positions 0..B-1
    n_draft: torch.Tensor  # [R, 2] drafts on each branch
    shared: list[int]  # per row, drafts the two branches share (stored once)
    copy_rows: list[int]  # rows with a second branch


def branches(proposals: list[NgramProposal]) -> list[list[int]] | None:
    """Per row its copy, the tree's second branch ([]: none); None when no row has one (the round stays a
    plain chain verify)."""
    out = [p.tokens for p in proposals]
    return out if any(out) else None


def build(block: torch.Tensor, n_draft: torch.Tensor, copies: list[list[int]], pad_id: int) -> Tree:
    """block [R, B] last token + the drafter's drafts, n_draft [R] its drafts to verify, copies per row the
    copied continuation ([]: no second branch, at most B-1 tokens) -> the rows' trees, padded with pad_id
    nodes that see only the cache and themselves."""
    R, B = block.shape
    rows, ns = block.tolist(), n_draft.tolist()
    nodes, depths, parents, paths, lens, shares = [], [], [], [], [], []
    for r in range(R):
        d, c = rows[r][1 : 1 + ns[r]], list(copies[r])
        m = 0
        while m < min(len(c), len(d)) and c[m] == d[m]:
            m += 1
        nodes.append([rows[r][0]] + d[:m] + c[m:] + d[m:])
        depths.append(list(range(len(c) + 1)) + list(range(m + 1, len(d) + 1)))
        tail_c, tail_d = list(range(m + 1, len(c) + 1)), list(range(len(c) + 1, len(c) + 1 + len(d) - m))
        parents.append([-1] + list(range(m)) + [p - 1 if p > m + 1 else m for p in tail_c])
        parents[-1] += [m if i == 0 else tail_d[i - 1] for i in range(len(tail_d))]
        shared = list(range(m + 1))
        paths.append([shared + tail_d, shared + tail_c])
        lens.append([len(d), len(c)])
        shares.append(m)
    n = max(len(x) for x in nodes)
    ids = torch.full((R, n), pad_id, dtype=torch.long)
    depth = torch.arange(n).repeat(R, 1)  # padding: any position, never judged
    anc = torch.eye(n, dtype=torch.bool).repeat(R, 1, 1)
    path_t = torch.zeros(R, 2, B, dtype=torch.long)
    for r in range(R):
        k = len(nodes[r])
        ids[r, :k] = torch.tensor(nodes[r])
        depth[r, :k] = torch.tensor(depths[r])
        for j in range(1, k):  # parents come first: a node's ancestors are its parent's plus itself
            anc[r, j] |= anc[r, parents[r][j]]
        for b in range(2):
            path_t[r, b, : len(paths[r][b])] = torch.tensor(paths[r][b])
    dev, with_copy = block.device, [r for r, c in enumerate(copies) if c]
    return Tree(
        ids.to(dev), depth.to(dev), anc.to(dev), path_t.to(dev), torch.tensor(lens, device=dev), shares, with_copy
    )


def along(x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """x [R, n, ...] per node -> [R, W, ...] along path [R, W] (one branch's chain positions)."""
    idx = path.view(*path.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, idx)


def pick(main: Verdict, copy: Verdict, has_copy: torch.Tensor) -> tuple[Verdict, torch.Tensor]:
    """main / copy: each branch's verdict [R]; has_copy [R] bool -> the kept verdict and won [R] bool
    (the copy's branch, strictly longer; ties keep the drafter's, whose verdict is then the same)."""
    won = has_copy & (copy.accepted > main.accepted)
    return Verdict(torch.where(won, copy.accepted, main.accepted), torch.where(won, copy.bonus, main.bonus)), won


@dataclass
class TreeVerdict:
    verdict: Verdict  # the kept branch's accepted drafts and bonus token [R]
    taps: torch.Tensor  # [R, B, taps*d] target features along the kept branch
    block: torch.Tensor  # [R, B] the kept branch as a chain (last token + its drafts)
    n_draft: torch.Tensor  # [R] the kept branch's drafts
    won: list[bool]  # per row: the copy's branch was kept
    losers: dict[int, int]  # per greedy row with a copy: the losing branch's accepted drafts
    judged: dict[int, int]  # per row with a copy: drafts judged over both branches (the shared prefix once)


def verify(target, cache, tap_layers, accept_ops, rows, pens, tree: Tree, q) -> TreeVerdict:
    """One tree round for a batch: verify both branches in one target pass, keep the longer and compact the
    target cache (modeling/cache.py) to it. rows: per row (params, generator); pens: per row its logit
    controls' state (decoding/penalties.py); q [R, B-1, V] the drafter's distributions or None. The caller
    (the engine) queues the returned features for the drafter and records the kept branch."""
    start = cache.lengths.clone()  # [R] slot of node 0
    out = target.forward(tree.ids, cache, tap_layers, tree=(tree.depth, tree.ancestors))
    blocks = [along(tree.ids, tree.paths[:, b]) for b in range(2)]  # [R, B] each branch's chain
    # logit controls along each branch, as a chain verify applies them
    logits = [penalties.apply(along(out.logits, tree.paths[:, b]), blocks[b][:, 1:], pens) for b in range(2)]
    verdict, won, losers = _accept(accept_ops, rows, tree, blocks, logits, q)
    path = torch.where(won[:, None], tree.paths[:, 1], tree.paths[:, 0])  # [R, B] the kept branch's nodes
    cache.gather_slots(start[:, None] + path, start)
    cache.crop(start + verdict.accepted + 1)
    n = tree.n_draft.tolist()
    return TreeVerdict(
        verdict,
        along(out.taps, path),
        torch.where(won[:, None], blocks[1], blocks[0]),
        torch.where(won, tree.n_draft[:, 1], tree.n_draft[:, 0]),
        won.tolist(),
        losers,
        {r: n[r][0] + n[r][1] - tree.shared[r] for r in tree.copy_rows},
    )


def _accept(accept_ops, rows, tree: Tree, blocks, logits, q) -> tuple[Verdict, torch.Tensor, dict[int, int]]:
    """blocks: [R, B] per branch, logits [R, B, V] along each, q [R, B-1, V] or None -> the kept verdict, won
    [R] (the copy's branch kept) and, per greedy row with a copy, the losing branch's accepted drafts. Sampled
    rows with a copy: two_branch_accept (decoding/verify.py; they draw 2B-1 uniforms). The others: the
    drafter's chain as the engine judges one (accept_rows) and, for greedy rows, the copy's greedy verdict."""
    R, B, dev = blocks[0].shape[0], blocks[0].shape[1], blocks[0].device
    walk = [r for r in tree.copy_rows if not rows[r][0].greedy]
    rest = torch.tensor([r for r in range(R) if r not in walk], dtype=torch.long, device=dev)
    accepted, bonus = torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.long, device=dev)
    if len(rest):
        sub_q = None if q is None else q[rest]
        sub = [rows[r] for r in rest.tolist()]
        v = accept_rows(accept_ops, blocks[0][rest], logits[0][rest], sub_q, tree.n_draft[rest, 0], sub, True, B)
        accepted[rest], bonus[rest] = v.accepted, v.bonus
    # the copy's branch as a greedy chain of its own length (accept_rows with q=None: drafts past it never match)
    copy = accept_rows(accept_ops, blocks[1], logits[1], None, tree.n_draft[:, 1], [], True, B)
    greedy_copy = torch.zeros(R, dtype=torch.bool, device=dev)
    greedy_copy[[r for r in tree.copy_rows if r not in walk]] = True
    verdict, won = pick(Verdict(accepted, bonus), copy, greedy_copy)
    lost = torch.where(won, accepted, copy.accepted).tolist()
    losers = {r: lost[r] for r in tree.copy_rows if r not in walk}
    for r in walk:
        params, gen = rows[r]
        nd, nc = tree.n_draft[r].tolist()
        u = torch.rand(2 * B - 1, generator=gen, device=dev)
        a, tok, kept_copy = two_branch_accept(
            blocks[0][r, 1 : 1 + nd].tolist(),
            blocks[1][r, 1 : 1 + nc].tolist(),
            warp_logits(logits[0][r, : nd + 1], params),
            warp_logits(logits[1][r, : nc + 1], params),
            q[r],
            u[: B - 1],
            u[B - 1 : 2 * B - 2],
            u[-1:],
        )
        verdict.accepted[r], verdict.bonus[r], won[r] = a, tok, kept_copy
    return verdict, won, losers
