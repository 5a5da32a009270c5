"""generate() (DFlash speculative decoding) and generate_baseline() (plain autoregressive decoding
on the same target adapter), for a batch of prompts with per-row lengths.

Boundary: batch-level entry points; their statistics are decoding/stats.py's DecodeStats (the
requests' added together), their stop rule decoding/stopping.py's. The per-step loop lives in
decoding/engine.py; both functions here use the same target adapter so that their speed ratio is
the speculative speedup alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash_trt.config import SamplingParams
from dflash_trt.decoding import penalties
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.options import EngineOptions
from dflash_trt.decoding.session import Session
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.decoding.stopping import StopRule, target_stop_ids
from dflash_trt.decoding.verify import sample_tokens, warp_logits


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per prompt (prompt excluded, stop token included)
    finish_reasons: list[str]
    stats: DecodeStats  # the batch's: every request's counts added (decoding/stats.py)


def _as_prompts(input_ids) -> list[list[int]]:
    if torch.is_tensor(input_ids):
        return [input_ids.tolist()] if input_ids.dim() == 1 else input_ids.tolist()
    if input_ids and isinstance(input_ids[0], int):
        return [list(input_ids)]
    return [list(p) for p in input_ids]


def _row_params(params: SamplingParams, r: int) -> SamplingParams:
    if params.seed is None:
        return params
    return SamplingParams(**{**params.__dict__, "seed": params.seed + r})


def generate(
    target,
    drafter,
    input_ids,
    params: SamplingParams | None = None,
    max_seq_len: int | None = None,
    options: EngineOptions | None = None,
    session: Session | None = None,
    _capture=None,
    **fields,
) -> GenerationResult:
    """DFlash speculative decoding of every prompt in input_ids (list of token lists or [R, L]).
    options: how to decode (decoding/options.py EngineOptions: proposer, draft length and cutoff, kernels,
    CUDA graph), `fields` replacing single ones (generate(t, d, ids, proposer="hybrid"));
    session: learned state to share with other calls (decoding/session.py; default: this call's own)."""
    params = params or SamplingParams()
    prompts = _as_prompts(input_ids)
    need = max(len(p) for p in prompts) + params.max_new_tokens + 1
    eng = SpecEngine(
        target,
        drafter,
        max_batch=len(prompts),
        max_seq_len=max_seq_len or need,
        options=EngineOptions.of(options, **fields),
        session=session,
        _capture=_capture,
    )
    t0 = time.perf_counter()
    eng.add_requests([(str(r), p, _row_params(params, r)) for r, p in enumerate(prompts)])
    tokens: dict[str, list[int]] = {str(r): [] for r in range(len(prompts))}
    reasons: dict[str, str] = {}
    per_req: dict[str, DecodeStats] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
                per_req[out.request_id] = out.stats
    stats = DecodeStats()
    for s in per_req.values():
        stats.add(s)
    first = next(iter(per_req.values()))
    stats.prefill_time = first.prefill_time
    stats.draft_time = max(s.draft_time for s in per_req.values())
    stats.verify_time = max(s.verify_time for s in per_req.values())
    stats.wall_time = time.perf_counter() - t0
    keys = [str(r) for r in range(len(prompts))]
    return GenerationResult([tokens[k] for k in keys], [reasons[k] for k in keys], stats)


@torch.no_grad()
def generate_baseline(
    target, input_ids, params: SamplingParams | None = None, max_seq_len: int | None = None
) -> GenerationResult:
    """Plain autoregressive decoding with the same target adapter: one target pass per token."""
    params = params or SamplingParams()
    prompts = _as_prompts(input_ids)
    R = len(prompts)
    cap = max_seq_len or (max(len(p) for p in prompts) + params.max_new_tokens + 1)
    eos = target_stop_ids(target)
    rules = [StopRule.for_request(params, eos, len(p), cap) for p in prompts]
    pens = [
        penalties.state_for(params, rule.stops, p, target.vocab_size, target.device) for rule, p in zip(rules, prompts)
    ]
    gens = []
    for r in range(R):
        g = torch.Generator(device=target.device)
        g.manual_seed(params.seed + r) if params.seed is not None else g.seed()
        gens.append(g)

    def pick(logits, rows):  # [A, V], A active rows (their indices into the batch) -> [A]
        logits = penalties.apply(logits[:, None], None, [pens[r] for r in rows])[:, 0]  # logit controls
        if params.greedy:
            return logits.argmax(-1)
        probs = warp_logits(logits, params)
        return torch.stack([sample_tokens(probs[a], gens[r]) for a, r in enumerate(rows)])

    t0 = time.perf_counter()
    cache = target.new_cache(R, cap)
    out = target.prefill(prompts, cache)
    active = list(range(R))
    tok = pick(out.logits[:, 0], active)
    prefill_time = time.perf_counter() - t0
    tokens: list[list[int]] = [[] for _ in range(R)]
    reasons: list[str | None] = [None] * R
    steps = 0
    while True:
        for r, t in zip(active, tok.tolist()):  # one token per active row (decoding/stopping.py)
            _, reasons[r] = rules[r].admit(len(tokens[r]), [t])
            tokens[r].append(t)
            if pens[r] is not None:
                pens[r].update([t])
        keep = [a for a, r in enumerate(active) if reasons[r] is None]
        if not keep:
            break
        if len(keep) < len(active):  # finished rows leave the batch: no compute spent on discarded tokens
            idx = torch.tensor(keep, device=tok.device)
            cache.select_rows(idx)
            tok, active = tok[idx], [active[a] for a in keep]
        out = target.forward(tok[:, None], cache)
        tok = pick(out.logits[:, -1], active)
        steps += 1
    wall = time.perf_counter() - t0
    stats = DecodeStats(
        num_prompt_tokens=sum(map(len, prompts)),
        num_output_tokens=sum(map(len, tokens)),
        num_verify_steps=steps,
        prefill_time=prefill_time,
        verify_time=wall - prefill_time,
        wall_time=wall,
    )
    return GenerationResult(tokens, reasons, stats)
