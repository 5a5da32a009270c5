"""SpecEngine: the DFlash draft -> verify -> accept -> rewind loop over a live batch of requests.

Boundary: owns per-request state (sampling params, RNG, outputs, statistics) and the batch's
caches; requests join (`add_request`) and leave (finish / `cancel`) between steps, so it serves
both `generate()` and the Triton orchestrator's continuous batching. What a round verifies is the
proposer's choice (decoding/proposers/: one module each, chosen once from a registry; the engine
never compares their names), which reads the batch through `draft()` / `copy_round()` and learns
from the verdicts (`observe`); the engine verifies (a chain, or a proposer's token tree:
decoding/tree.py), accepts, rewinds and keeps the caches. How to decode is one EngineOptions
(decoding/options.py), what engines learn a Session (decoding/session.py). Model math lives in
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
from dflash_trt.decoding import context_queue, penalties, proposal, tree
from dflash_trt.decoding.draft_length import check_cutoff, draft_lengths
from dflash_trt.decoding.ngram import NgramProposal, SuffixIndex
from dflash_trt.decoding.options import EngineOptions
from dflash_trt.decoding.prompt import check_prompt
from dflash_trt.decoding.proposal import Proposal
from dflash_trt.decoding.proposers import plan as plan_proposer
from dflash_trt.decoding.records import NgramRecord
from dflash_trt.decoding.session import Session
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.decoding.stopping import StopRule, target_stop_ids
from dflash_trt.decoding.verify import Verdict, accept_ops, accept_rows, sample_tokens, warp_logits
from dflash_trt.decoding.verify_cost import VerifyCost
from dflash_trt.errors import DFlashError
from dflash_trt.families import dflash
from dflash_trt.modeling.cuda_graph import propose_graphs


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
    index: SuffixIndex | None = None  # copying proposers: the row's text (prompt + output) for copied drafts
    ngram: NgramRecord | None = None  # copying proposers: how the copied drafts fared (decoding/records.py)
    pen: penalties.PenaltyState | None = None  # its logit controls' counts (None: it sets none)


class SpecEngine:
    def __init__(
        self,
        target,
        drafter,
        max_batch: int = 16,
        max_seq_len: int | None = None,
        options: EngineOptions | None = None,
        verify_cost: VerifyCost | None = None,
        session: Session | None = None,
        _capture=None,
        **fields,
    ):
        """options: how to decode (decoding/options.py EngineOptions: proposer, draft length and cutoff,
        kernels, CUDA graph); `fields` replace single options (SpecEngine(t, d, proposer="ngram")).
        verify_cost: the verify cost curve for draft_length="cost" and the hybrid's pay gate (default: the
        session's, measured on first use, decoding/verify_cost.py).
        session: what engines learn about the drafter and the machine (decoding/session.py); pass the same
        Session to engines that should share it (default: a fresh one, this engine's own).
        _capture: tests only, a stand-in for CUDA graph capture (cuda_graph.eager_capture)."""
        opts = self.options = EngineOptions.of(options, **fields)
        kernels, cuda_graph, draft_cutoff = opts.kernels, opts.cuda_graph, opts.draft_cutoff
        draft_length, proposer = opts.draft_length, opts.proposer
        self.target, self.drafter = target, drafter
        self.accept_ops = accept_ops(kernels, target.device)
        # the drafter object is shared, so every engine sets its switch; drafters without one
        # (test doubles) have no kernels to run
        self.drafter_kernels = drafter.use_kernels(kernels) if hasattr(drafter, "use_kernels") else "torch"
        self.kernels = kernels
        self.draft_cutoff = check_cutoff(draft_cutoff)
        self.family = getattr(drafter, "family", dflash)  # test doubles draft as plain DFlash
        offered = self.family.lengths(drafter.config) if hasattr(drafter, "config") else ("probability",)
        plan = plan_proposer(draft_length, self.draft_cutoff, proposer, self.family, offered)
        self.length_source, self.cost_source = plan.length_source, plan.cost_source
        self.needs, self.variable = plan.needs, plan.variable
        self.graphs = propose_graphs(cuda_graph, drafter, self.drafter_kernels, target.device, _capture)
        self.block_size = drafter.block_size
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len or 4096, target.max_context())
        self.tap_layers = list(drafter.target_layer_ids)
        self.eos = target_stop_ids(target)
        self.session = session or Session()
        self.cost = None
        if self.length_source == "cost" or plan.proposer.gated:
            self.cost = verify_cost or self.session.verify_cost(
                target, min(max_batch * self.block_size, 512), self.tap_layers
            )
        self.proposer = plan.proposer(self.session.record(plan.proposer.name), self.cost)
        self.draft_seconds = 0.0  # running mean of the propose step's time
        self.deferred = False  # pending holds features of rounds without the drafter (decoding/context_queue.py)
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
            self.proposer.start(req, ids)
            reqs.append(req)
            prompts.append(ids)
        t0 = time.perf_counter()
        cap = self.max_seq_len + self.block_size * self.proposer.cache_blocks
        tcache, dcache = self.target.new_cache(len(items), cap), self.drafter.new_cache(len(items), cap)
        out = self.target.prefill(prompts, tcache, self.tap_layers)
        lens = tcache.lengths.clone()
        if self.proposer.uses_drafter:
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
        t1 = time.perf_counter()
        self.draft_seconds = t1 - t0 if not self.draft_seconds else 0.8 * self.draft_seconds + 0.2 * (t1 - t0)
        if prop.tree is None:
            # rows verify together; a shorter row's extra drafts are not judged (no host sync at full width)
            width = int(prop.n_draft.max()) + 1 if self.variable else self.block_size
            block = prop.block[:, :width]
            out = self.verify(block)
            verdict = self.accept(block, out.logits, None if prop.q is None else prop.q[:, : width - 1], prop.n_draft)
            self.rewind(verdict, out.taps)
        else:
            verdict = self._verify_tree(prop)
        t2 = time.perf_counter()
        accepted, bonus, drafted = verdict.accepted.tolist(), verdict.bonus.tolist(), prop.n_draft.tolist()
        drafts = prop.block[:, 1:].tolist()
        survival = None if prop.predicted is None else prop.predicted.float().cumprod(dim=1).tolist()
        for r, req in enumerate(self.reqs):
            a, copied = accepted[r], prop.copied[r]
            predicted = None if survival is None or copied else survival[r][: drafted[r]]
            req.stats.record(a, drafted[r], predicted, copied)
            req.stats.draft_time += t1 - t0
            req.stats.verify_time += t2 - t1
            self._emit(req, drafts[r][:a] + [bonus[r]])
        self.proposer.observe(self, prop, verdict, t1 - t0)
        self._drop_finished()

    def propose(self) -> Proposal:
        """This round's Proposal: the proposer's (decoding/proposers/), cut to the most profitable verify
        width with draft_length=cost."""
        return self._by_cost(self.proposer.propose(self))

    def draft(self) -> Proposal:
        """The drafter's block for every row (proposers call this): its queued context injected, then its
        family's propose (families/), or the same two calls replayed from a CUDA graph; the draft length
        from the drafter's confidence where draft_length asks for it (decoding/draft_length.py)."""
        R, B = len(self.reqs), self.block_size
        rows = [(r.params, r.generator) for r in self.reqs]
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
        prop = Proposal(block, q, n_draft, conf.get("confidence"), [False] * R, conf.get("probability"))
        prop.estimates = conf.get(self.cost_source)
        return prop

    def copy_round(self, proposals: list[NgramProposal]) -> Proposal:
        """A round without the drafter (proposers call this): rows verify their copies (proposals per row;
        [] or an empty copy: a plain step); the drafter's context waits in its queue."""
        self._defer()
        return proposal.copy_all(
            self.last, self.reqs, self.block_size, self.drafter.mask_token_id, self.target.vocab_size, proposals
        )

    def _verify_tree(self, prop: Proposal) -> Verdict:
        """A tree proposal (decoding/tree.py): verify both branches in one pass; the target cache keeps the
        longer accepted one, whose features join the drafter's queue; prop becomes the kept branch."""
        rows = [(r.params, r.generator) for r in self.reqs]
        pens = [r.pen for r in self.reqs]
        tv = tree.verify(self.target, self.tcache, self.tap_layers, self.accept_ops, rows, pens, prop.tree, prop.q)
        self.pending, self.pending_n, self.last = tv.taps, tv.verdict.accepted + 1, tv.verdict.bonus
        prop.block, prop.n_draft, prop.losers = tv.block, tv.n_draft, tv.losers
        prop.copied = [c or w for c, w in zip(prop.copied, tv.won)]
        for r, judged in tv.judged.items():
            self.reqs[r].stats.record_tree(judged, tv.won[r])
        return tv.verdict

    def _inject(self) -> None:
        """The drafter's context catches up with the target's: every queued feature is injected (the queue
        cut to its longest row: it grows by doubling, and a column past every row's entries is padding that
        would only ask the drafter cache for room it does not have)."""
        width = int(self.pending_n.max()) if self.pending_n.numel() else 0
        self.drafter.inject_context(self.pending[:, :width], self.pending_n, self.dcache)
        self.deferred = False

    def _defer(self) -> None:
        """A round without the drafter: its context waits in the queue (decoding/context_queue.py), unless
        the queue is full, the drafter replays from a CUDA graph (which takes one block's width), or the
        drafter cache would have no room left for the queue after this round's verify and the next block
        (in a batch, one row's long queue is written past every row's length: padding, but it needs room)."""
        B = self.block_size
        room = self.dcache.room() - B * (self.proposer.cache_blocks + 1)
        if self.graphs is not None or context_queue.full(self.pending, B) or int(self.pending_n.max()) > room:
            self._inject()
        else:
            self.deferred = True

    def _by_cost(self, prop: Proposal) -> Proposal:
        """draft_length=cost: the batch's most profitable verify width (decoding/proposal.py cut_by_cost)."""
        if self.length_source != "cost":
            return prop
        return proposal.cut_by_cost(prop, prop.estimates, self.cost, self.draft_seconds)

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
