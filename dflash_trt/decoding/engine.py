"""SpecEngine: the DFlash draft -> verify -> accept -> rewind loop over a live batch of requests.

Boundary: owns per-request state (sampling params, RNG, outputs, statistics) and the batch's
caches; requests join (`add_request`) and leave (finish / `cancel`) between steps, so it serves
both `generate()` and the Triton orchestrator's continuous batching. Model math lives in
modeling/, how a drafter family turns its block into drafts and q in families/ (propose),
acceptance math in decoding/verify.py; the statistics type, the stop/length rule and
the prompt check it applies are decoding/stats.py, stopping.py and prompt.py.

Per row, between steps: the target cache holds every verified token except `last` (the token
that opens the next block); the drafter cache holds context K/V for the same positions except
the `pending` target features (the last verify's, or every verify's since the drafter last ran:
decoding/context_queue.py), which are injected when the drafter next runs. So the drafter cache's
length plus pending_n is the target cache's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_trt.config import SamplingParams
from dflash_trt.decoding import context_queue, hybrid, penalties, proposal, tree
from dflash_trt.decoding import verify_cost as verify_costs
from dflash_trt.decoding.draft_length import check_cutoff, draft_lengths
from dflash_trt.decoding.hybrid import NgramRecord
from dflash_trt.decoding.ngram import NgramProposal, SuffixIndex
from dflash_trt.decoding.prompt import check_prompt
from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.decoding.stopping import StopRule, target_stop_ids
from dflash_trt.decoding.verify import Verdict, accept_rows, sample_tokens, warp_logits
from dflash_trt.decoding.verify_cost import VerifyCost
from dflash_trt.errors import DFlashError
from dflash_trt.families import dflash
from dflash_trt.modeling import fast_path
from dflash_trt.modeling.cuda_graph import propose_graphs

PROPOSERS = proposal.PROPOSERS
# draft_length=cost: a drafter that has not been paying is still tried every 8th round, then every 16th, ...
# each time a try shows it still not paying, up to every 64th (exponential back-off: every try costs a draft
# pass and a wider verify, and off its training distribution a drafter rarely starts paying again)
PROBE_EVERY, PROBE_EVERY_MAX = 8, 64
NO_COPY = NgramProposal([], 0)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None while running
    stats: DecodeStats  # this request's alone (decoding/stats.py)


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    generator: torch.Generator
    rule: StopRule
    stats: DecodeStats
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    index: SuffixIndex | None = None  # proposer=hybrid: the row's text (prompt + output) for copied drafts
    ngram: NgramRecord | None = None  # proposer=hybrid: how the copied drafts fared
    pen: penalties.PenaltyState | None = None  # its logit controls' counts (None: it sets none)


class SpecEngine:
    def __init__(
        self,
        target,
        drafter,
        max_batch: int = 16,
        max_seq_len: int | None = None,
        kernels: str = "auto",
        cuda_graph: str = "auto",
        draft_cutoff: float = 0.0,
        draft_length: str = "block",
        proposer: str = "dflash",
        verify_cost: VerifyCost | None = None,
        _capture=None,
    ):
        """kernels: "auto" | "triton" | "torch" (see modeling/fast_path.py): the drafter's context
        injection and block attention and the acceptance step on the Triton kernels or PyTorch.
        cuda_graph: "auto" | "on" | "off": replay the drafter's propose step from a CUDA graph
        (modeling/cuda_graph.py; needs the Triton kernels on a CUDA device; auto = when they run).
        draft_cutoff: verify only the leading drafts whose cumulative drafter confidence is at least
        this (decoding/draft_length.py); 0 verifies the whole block every step.
        draft_length: "block" (the drafter's own probabilities, when draft_cutoff > 0) or "confidence"
        (the drafter's learned acceptance head, DSpark's: the cutoff applies to its predictions).
        proposer: "dflash" (the drafter's block), "ngram" (the continuation copied from the row's own
        text, decoding/ngram.py; the drafter is not run), "none" (no drafts: plain decoding, as served) or
        "hybrid" (per row and round, the copy when it is expected to get more drafts accepted than the
        drafter's block; decoding/hybrid.py) or "tree"
        (both verified in one pass as a token tree, the longer accepted branch kept; decoding/tree.py), or
        "auto" (hybrid where the drafter family gives per-draft probabilities, else dflash: proposal.resolve).
        verify_cost: draft_length="cost" only, the verify cost curve (default: measured here at start-up,
        decoding/verify_cost.py).
        _capture: tests only, a stand-in for CUDA graph capture (cuda_graph.eager_capture)."""
        self.target, self.drafter = target, drafter
        self.accept_ops = fast_path.accept_ops(kernels, target.device)
        # the drafter object is shared, so every engine sets its switch; drafters without one
        # (test doubles) have no kernels to run
        self.drafter_kernels = drafter.use_kernels(kernels) if hasattr(drafter, "use_kernels") else "torch"
        self.kernels = kernels
        self.draft_cutoff = check_cutoff(draft_cutoff)
        self.family = getattr(drafter, "family", dflash)  # test doubles draft as plain DFlash
        offered = self.family.lengths(drafter.config) if hasattr(drafter, "config") else ("probability",)
        proposer = proposal.resolve(proposer, offered)
        plan = proposal.plan(draft_length, self.draft_cutoff, proposer, self.family.LABEL, offered)
        self.length_source, self.cost_source, self.proposer = plan.length_source, plan.cost_source, proposer
        self.needs, self.variable = plan.needs, plan.variable
        self.graphs = propose_graphs(cuda_graph, drafter, self.drafter_kernels, target.device, _capture)
        self.block_size = drafter.block_size
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len or 4096, target.max_context())
        self.tap_layers = list(drafter.target_layer_ids)
        self.eos = target_stop_ids(target)
        self.cost = None
        if self.length_source == "cost":
            self.cost = verify_cost or verify_costs.for_target(
                target, min(max_batch * self.block_size, 512), self.tap_layers
            )
        self.draft_seconds = 0.0  # running mean of the propose step's time, for draft_length=cost
        self.skipped = 0  # draft_length=cost: rounds the drafter has been skipped since its last probe
        self.probe_every = PROBE_EVERY  # draft_length=cost: skipped rounds before the next probe
        self.deferred = False  # pending holds features of rounds without the drafter (decoding/context_queue.py)
        self.record = hybrid.record_of(drafter, proposer)  # the drafter's recent rounds, shared by engines over it
        self.reqs: list[_Request] = []  # row order of every batch tensor below
        self.tcache = self.dcache = None
        self.last = self.pending = self.pending_n = None  # [R], [R, B, taps*d], [R]
        self._finished_unreported: list[_Request] = []

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.add_requests([(request_id, prompt_ids, params)])

    def add_requests(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Prefill new requests together and join them to the running batch."""
        if not items:
            return
        if len(self.reqs) + len(items) > self.max_batch:
            raise DFlashError(f"batch full: {len(self.reqs)} running + {len(items)} new > max_batch={self.max_batch}")
        known = {r.request_id for r in self.reqs}
        prompts, reqs = [], []
        for rid, ids, params in items:
            ids = [int(t) for t in (ids.tolist() if torch.is_tensor(ids) else ids)]
            self._validate(rid, ids, known)
            known.add(rid)
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
            rule = StopRule.for_request(params, self.eos, len(ids), self.max_seq_len)
            req = _Request(rid, params, gen, rule, DecodeStats(self.block_size, len(ids)))
            req.pen = penalties.state_for(params, rule.stops, ids, self.target.vocab_size, self.target.device)
            if self.proposer not in ("dflash", "none"):
                req.index, req.ngram = SuffixIndex(ids), self.record.start()
            reqs.append(req)
            prompts.append(ids)
        t0 = time.perf_counter()
        cap = self.max_seq_len + self.block_size * (2 if self.proposer == "tree" else 1)  # a tree: 2B-1 wide
        tcache, dcache = self.target.new_cache(len(items), cap), self.drafter.new_cache(len(items), cap)
        out = self.target.prefill(prompts, tcache, self.tap_layers)
        lens = tcache.lengths.clone()
        if self.proposer not in ("ngram", "none"):  # these proposers never run the drafter
            self.drafter.inject_context(out.taps, lens, dcache)
        first = torch.stack([self._sample(req, out.logits[r, 0]) for r, req in enumerate(reqs)])
        dt = time.perf_counter() - t0
        B = self.block_size
        pending = torch.zeros(len(items), B, out.taps.shape[-1], dtype=out.taps.dtype, device=out.taps.device)
        for req, tok in zip(reqs, first.tolist()):
            req.stats.prefill_time = dt
            self._emit(req, [tok])
        self._join(reqs, tcache, dcache, first, pending, torch.zeros_like(lens))
        self._drop_finished()

    def _validate(self, rid: str, ids: list[int], known: set) -> None:
        if rid in known:
            raise DFlashError(f"request_id {rid!r} is already running")
        check_prompt(ids, self.target.vocab_size, self.max_seq_len)

    def _join(self, reqs, tcache, dcache, last, pending, pending_n) -> None:
        if not self.reqs:
            self.tcache, self.dcache, self.last, self.pending, self.pending_n = tcache, dcache, last, pending, pending_n
        else:
            self.tcache.extend(tcache)
            self.dcache.extend(dcache)
            self.last = torch.cat([self.last, last])
            width = max(self.pending.shape[1], pending.shape[1])  # a waiting queue may be wider than a block
            self.pending = torch.cat([context_queue.pad(self.pending, width), context_queue.pad(pending, width)])
            self.pending_n = torch.cat([self.pending_n, pending_n])
        self.reqs.extend(reqs)

    def cancel(self, request_id: str) -> None:
        for req in self.reqs:
            if req.request_id == request_id and req.finish_reason is None:
                req.finish_reason = "cancelled"
        self._drop_finished()

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or bool(self._finished_unreported)

    # ---- one speculative step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One draft/verify round for every running row; returns what each request gained."""
        if self.reqs:
            self._round()
        outputs = [self._report(r) for r in self._finished_unreported]
        outputs += [self._report(r) for r in self.reqs if r.unsent]
        self._finished_unreported = []
        return outputs

    def _round(self) -> None:
        t0 = time.perf_counter()
        prop = self.propose()
        block, n_draft = prop.block, prop.n_draft
        t1 = time.perf_counter()
        self.draft_seconds = t1 - t0 if not self.draft_seconds else 0.8 * self.draft_seconds + 0.2 * (t1 - t0)
        # rows verify together; a shorter row's extra drafts are not judged (no host sync at full width)
        width = int(n_draft.max()) + 1 if self.variable else self.block_size
        if prop.copies is None:
            out = self.verify(block[:, :width])
            q = None if prop.q is None else prop.q[:, : width - 1]
            verdict = self.accept(block[:, :width], out.logits, q, n_draft)
            t2 = time.perf_counter()
            self.rewind(verdict, out.taps)
        else:  # proposer=tree: verify, accept and rewind the two-branch tree (prop becomes the kept branch)
            verdict, t2 = tree.verify_round(self, prop), time.perf_counter()
            block, n_draft = prop.block, prop.n_draft
        accepted, bonus, drafted = verdict.accepted.tolist(), verdict.bonus.tolist(), n_draft.tolist()
        drafts = block[:, 1:].tolist()
        survival = None if prop.predicted is None else prop.predicted.float().cumprod(dim=1).tolist()
        claimed = None  # hybrid: what the drafter's probabilities expected of its verified drafts
        if self.proposer in ("hybrid", "tree") and prop.probability is not None:
            claimed = prop.probability.float().cumprod(dim=1).tolist()
        for r, req in enumerate(self.reqs):
            a, copied = accepted[r], prop.copied[r]
            predicted = None if survival is None or copied else survival[r][: drafted[r]]
            req.stats.record(a, drafted[r], predicted, copied)
            if copied:
                req.ngram.record_copy(drafted[r], a)
            elif prop.drafter_ran:
                self.record.add(a, drafted[r], t1 - t0)
                if claimed is not None:
                    req.ngram.record_drafter(sum(claimed[r][: drafted[r]]), a)
            req.stats.draft_time += t1 - t0
            req.stats.verify_time += t2 - t1
            self._emit(req, drafts[r][:a] + [bonus[r]])
        self._drop_finished()

    def propose(self) -> Proposal:
        """Inject last round's target features, draft a block through the drafter's family (families/);
        rows whose own text offers a better continuation take it instead (hybrid, decoding/hybrid.py)."""
        R, B = len(self.reqs), self.block_size
        rows = [(r.params, r.generator) for r in self.reqs]
        mask, V = self.drafter.mask_token_id, self.target.vocab_size
        # copied rows' P(drafts 1..j+1 accepted), for the hybrid choice and the cost cut
        survivals = None if self.proposer in ("dflash", "none") else [r.ngram.survival(B - 1) for r in self.reqs]
        if self.proposer in ("ngram", "none"):  # none: no drafts, every row takes a plain decode step
            plain = [NO_COPY] * R if self.proposer == "none" else None
            return self._by_cost(proposal.copy_all(self.last, self.reqs, B, mask, V, plain), {}, survivals)
        proposals = [NO_COPY] * R
        if self.proposer != "dflash":
            proposals = [r.index.propose(B - 1, hybrid.MIN_MATCH) for r in self.reqs]
        if self._skip_drafter(proposals, survivals):
            self._defer()
            return self._by_cost(proposal.copy_all(self.last, self.reqs, B, mask, V, proposals), {}, survivals)
        if self.graphs is not None:  # the same two calls, replayed from a CUDA graph (plain DFlash only)
            block, logits = self.graphs(self.pending, self.pending_n, self.last, self.dcache)
            gated = "probability" in self.needs
            block, q, conf = dflash.choose(block, logits, None, rows, gated, warp_logits, sample_tokens)
            conf = {} if conf is None else {"probability": conf}
        else:
            self._inject()
            block = torch.full((R, B), self.drafter.mask_token_id, dtype=torch.long, device=self.last.device)
            block[:, 0] = self.last
            block, q, conf = self.family.propose(
                self.drafter, block, self.dcache, rows, self.needs, warp_logits, sample_tokens
            )
        if self.length_source in (None, "cost"):
            n_draft = torch.full((R,), B - 1, dtype=torch.long, device=self.last.device)
        else:
            n_draft = draft_lengths(conf[self.length_source], self.draft_cutoff)
        copied, copies = [False] * R, None
        if self.proposer == "tree":  # every row's copy is verified beside the block, no choice (decoding/tree.py)
            copies = tree.branches(proposals)
        elif self.proposer == "hybrid":
            calibrations = [r.ngram.calibration for r in self.reqs]
            copied = hybrid.choose(block, q, n_draft, conf["probability"], proposals, survivals, calibrations)
        prop = Proposal(block, q, n_draft, conf.get("confidence"), copied, conf.get("probability"), copies=copies)
        return self._by_cost(prop, conf, survivals)

    def _skip_drafter(self, proposals, survivals) -> bool:
        """Rounds without the drafter: every row has a copy expected to do at least as well as the
        drafter has been doing (hybrid), or, with draft_length=cost, drafting has not been paying
        for itself against plain decode steps (probed every PROBE_EVERY skipped rounds)."""
        record = self.record
        if self.proposer != "dflash" and hybrid.copies_win(proposals, survivals, record):
            return True
        if self.length_source != "cost" or not record.rounds:
            return False
        if verify_costs.drafter_pays(record.accepted, 1.0 + record.drafted, record.seconds, len(self.reqs), self.cost):
            self.skipped, self.probe_every = 0, PROBE_EVERY
            return False
        self.skipped += 1
        if self.skipped < self.probe_every:
            return True
        self.skipped, self.probe_every = 0, min(2 * self.probe_every, PROBE_EVERY_MAX)  # probe this round
        return False

    def _inject(self) -> None:
        """The drafter's context catches up with the target's: every queued feature is injected."""
        self.drafter.inject_context(self.pending, self.pending_n, self.dcache)
        self.deferred = False

    def _defer(self) -> None:
        """A round without the drafter: its context waits in the queue (decoding/context_queue.py), unless
        the queue is full or the drafter replays from a CUDA graph, which takes one block's width."""
        if self.graphs is not None or self.pending.shape[1] >= context_queue.MAX_BLOCKS * self.block_size:
            self._inject()
        else:
            self.deferred = True

    def _by_cost(self, prop: Proposal, conf: dict, survivals: list[list[float]] | None) -> Proposal:
        """survivals: the copied rows' (None: no row can copy, proposer=dflash)."""
        if self.length_source != "cost":
            return prop
        return proposal.cut_by_cost(prop, conf.get(self.cost_source), survivals, self.cost, self.draft_seconds)

    def verify(self, block: torch.Tensor):
        """The target scores the block (the last token and the drafts to verify) in one pass:
        block [R, W] -> logits [R, W, V], taps [R, W, taps*d]."""
        return self.target.forward(block, self.tcache, self.tap_layers)

    def accept(
        self, block: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None, n_draft: torch.Tensor
    ) -> Verdict:
        """block [R, W], logits [R, W, V], q [R, W-1, V] or None; row r judges its first n_draft[r] drafts
        (decoding/verify.py, or the Triton accept kernels) on its logit controls' logits (penalties.py)."""
        logits = penalties.apply(logits, block[:, 1:], [r.pen for r in self.reqs])  # [R, W, V]
        rows = [(r.params, r.generator) for r in self.reqs]
        return accept_rows(self.accept_ops, block, logits, q, n_draft, rows, self.variable, self.block_size)

    def rewind(self, verdict: Verdict, taps: torch.Tensor) -> None:
        """Crop the target cache to the accepted prefix; queue its features for the drafter (padded to
        the block width, the shape the drafter's step and its CUDA graph take; after the waiting ones when
        the drafter was skipped)."""
        W = taps.shape[1]
        self.tcache.crop(self.tcache.lengths - W + verdict.accepted + 1)
        if self.deferred:
            self.pending, self.pending_n = context_queue.append(
                self.pending, self.pending_n, taps, verdict.accepted + 1, self.block_size
            )
        else:
            self.pending, self.pending_n = context_queue.pad(taps, self.block_size), verdict.accepted + 1
        self.last = verdict.bonus

    # ---- bookkeeping --------------------------------------------------------------------
    def _sample(self, req: _Request, logits: torch.Tensor) -> torch.Tensor:  # [V] -> one token
        logits = penalties.apply(logits[None, None], None, [req.pen])[0, 0]
        if req.params.greedy:
            return logits.argmax(-1)
        return sample_tokens(warp_logits(logits, req.params), req.generator)

    def _emit(self, req: _Request, tokens: list[int]) -> None:
        """Append tokens up to the first stop token / token budget / context limit (decoding/stopping.py)."""
        if req.finish_reason is not None:
            return
        keep, req.finish_reason = req.rule.admit(len(req.output), tokens)
        req.output += tokens[:keep]
        if req.pen is not None:
            req.pen.update(tokens[:keep])
        if req.index is not None:
            req.index.extend(tokens[:keep])
        req.unsent += tokens[:keep]
        req.stats.num_output_tokens = len(req.output)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.reqs) if r.finish_reason is None]
        if len(keep) == len(self.reqs):
            return
        self._finished_unreported += [r for r in self.reqs if r.finish_reason is not None]
        self.reqs = [self.reqs[i] for i in keep]
        if not keep:
            self.tcache = self.dcache = self.last = self.pending = self.pending_n = None
            self.deferred = False
            return
        rows = torch.tensor(keep, device=self.last.device)
        self.tcache.select_rows(rows)
        self.dcache.select_rows(rows)
        self.last, self.pending, self.pending_n = self.last[rows], self.pending[rows], self.pending_n[rows]

    def _report(self, req: _Request) -> RequestOutput:
        new, req.unsent = req.unsent, []
        return RequestOutput(req.request_id, new, req.finish_reason is not None, req.finish_reason, req.stats)
