"""Evaluate a drafter by real generation: tau, per-position acceptance, speedup over the baseline.

Boundary: runs DFlash and the autoregressive baseline on the same held-out prompts, one prompt at
a time, interleaved (A B A B) after a short warm-up of each, so both see the same machine state;
greedy outputs must agree in fp32 (a difference is a bug and raises); in bf16/fp16 they are counted.
"""

from __future__ import annotations

import dataclasses

from dflash_trt.api import (
    DTYPES,
    dtype_name,
    encode,
    inexact_greedy_note,
    load_drafter,
    load_target,
    load_tokenizer,
    set_block_size,
    stop_ids,
)
from dflash_trt.config import SamplingParams
from dflash_trt.contention import CpuWatch, contention_warning
from dflash_trt.decoding.draft_length import check_cutoff, length_source
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.options import DEFAULT_PROPOSER, EngineOptions
from dflash_trt.decoding.session import Session
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.errors import DFlashError
from dflash_trt.train.prompts import load_prompts


def evaluate(
    target: str,
    drafter_dir: str,
    source: str,
    limit: int = 8,
    max_new_tokens: int = 128,
    chat: bool = True,
    dtype: str = "auto",
    target_model=None,
    block_sizes: list[int] | None = None,
    device: str = "auto",
    draft_cutoffs: list[float] | None = None,
    draft_length: str = "block",
    proposer: str = DEFAULT_PROPOSER,
) -> dict:
    """DFlash at each of `block_sizes` (default: the drafter's own) x `draft_cutoffs` (default 0: verify
    every draft; decoding/draft_length.py) against the baseline, per prompt interleaved. A drafter
    trained at B runs at any smaller block (fewer MASK slots): a CPU, where a verify pass costs more
    per token than on a GPU, often pays off best at a block well below B, or at B with the verify
    width cut to the drafts the drafter is sure of. The top-level fields are those of the first
    configuration; "sweep" lists every one. draft_length: what the cutoffs gate ("block": the drafter's
    probabilities; "confidence": a DSpark drafter's confidence head, every cutoff then > 0). proposer:
    where the drafts come from (decoding/options.py EngineOptions.proposer; the default dflash measures the
    drafter alone, auto / hybrid mix copied drafts in where they pay); rows carry `sources`, the steps /
    drafts / accepted drafts of the drafter and of the copied text."""
    cutoffs = list(dict.fromkeys(draft_cutoffs or [0.0]))
    for c in cutoffs:  # before any model loads
        length_source(draft_length, check_cutoff(c, "--draft-cutoff"), "--draft-length")
    prompts = load_prompts(source, limit)
    if target_model is None:
        tgt, path = load_target(target, dtype, device=device)
    else:
        tgt, path = target_model
    drafter = load_drafter(tgt, drafter_dir)
    trained_b = drafter.block_size
    sizes = list(dict.fromkeys(block_sizes or [trained_b]))
    configs = [(b, c) for b in sizes for c in cutoffs]
    for b in sizes:
        if not 2 <= b <= trained_b:
            raise DFlashError(
                f"--block-size {b}: choose 2..{trained_b} (the drafter was trained with block size "
                f"{trained_b}; larger blocks have MASK slots it never learned)"
            )
    tok = load_tokenizer(path)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids(tok))
    spec, base = {k: DecodeStats() for k in configs}, DecodeStats()
    # per configuration, what the engine learns carries over the prompts (decoding/session.py)
    options = {(b, c): EngineOptions(proposer, draft_length, c) for b, c in configs}
    sessions = {k: Session() for k in configs}
    mismatches = 0
    if prompts:  # warm-up (discarded): the first timed run must not pay one-off allocation/dispatch costs
        ids = encode(tok, prompts[0], chat)[:48]
        short = dataclasses.replace(params, max_new_tokens=min(8, max_new_tokens))
        generate_baseline(tgt, [ids], short)
        for b, c in configs:
            set_block_size(drafter, b)
            generate(tgt, drafter, [ids], short, options=options[b, c], session=sessions[b, c])
    with CpuWatch() as watch:
        for p in prompts:
            ids = encode(tok, p, chat)
            b_out = generate_baseline(tgt, [ids], params)
            base.merge(b_out.stats)
            for b, c in configs:
                set_block_size(drafter, b)
                a = generate(tgt, drafter, [ids], params, options=options[b, c], session=sessions[b, c])
                mismatches += a.tokens != b_out.tokens
                spec[b, c].merge(a.stats)
    if mismatches and inexact_greedy_note(tgt.dtype) is None:
        raise DFlashError(
            f"{mismatches} run(s) gave different greedy output with DFlash: this is a bug, "
            f"please report it with the prompt"
        )

    def row(b: int, c: float) -> dict:
        st = spec[b, c]
        return {
            "block_size": b,
            "draft_cutoff": c,
            "draft_length": draft_length,
            "proposer": proposer,
            "tau": st.tau,
            "predicted_tau": st.predicted_tau,
            "verified_drafts_per_step": st.drafts_per_step,
            "acceptance_rate": st.acceptance_rate,
            "per_position_acceptance": st.per_position_acceptance,
            "predicted_per_position": st.predicted_per_position,
            "accept_hist": st.accept_hist,
            "sources": st.sources,
            "dflash_tokens_per_s": st.decode_tokens_per_s,
            "speedup": st.decode_tokens_per_s / base.decode_tokens_per_s if base.decode_tokens_per_s else None,
        }

    rows = [row(b, c) for b, c in configs]
    return {
        "num_prompts": len(prompts),
        **rows[0],
        "baseline_tokens_per_s": base.decode_tokens_per_s,
        "dtype": dtype_name(tgt.dtype),
        "mismatches": mismatches,
        "trained_block_size": trained_b,
        "sweep": rows,
        "other_cpu_share": watch.others_share,
    }


def print_eval(res: dict) -> None:
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    rows = res.get("sweep") or [res]
    t = Table(
        title=f"DFlash eval (proposer {res.get('proposer', 'dflash')}) on {res['num_prompts']} held-out prompts "
        f"(drafter trained at block size {res.get('trained_block_size', res['block_size'])})"
    )
    for col in ("block", "cutoff", "drafts verified", "tau", "acceptance", "DFlash tok/s", "baseline tok/s", "speedup"):
        t.add_column(col, justify="right")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "n/a"
        t.add_row(
            str(r["block_size"]),
            f"{r.get('draft_cutoff', 0.0):g}",
            f"{r.get('verified_drafts_per_step', r['block_size'] - 1):.1f}",
            f"{r['tau']:.2f}",
            f"{r['acceptance_rate']:.2f}",
            f"{r['dflash_tokens_per_s']:.1f}",
            f"{res['baseline_tokens_per_s']:.1f}",
            sp,
        )
    Console().print(t)
    if res.get("mismatches"):
        note = inexact_greedy_note(DTYPES[res["dtype"]])
        Console().print(
            f"{res['mismatches']} DFlash run(s) differ from the baseline's greedy output: {note}",
            style="bold yellow",
            markup=False,
            highlight=False,
        )
    if warn := contention_warning(res.get("other_cpu_share")):
        Console().print(warn, style="bold yellow", markup=False, highlight=False)
    for r in rows:
        Console().print(
            f"per-position acceptance (block {r['block_size']}, cutoff {r.get('draft_cutoff', 0.0):g}): "
            + " ".join(f"{p:.2f}" for p in r["per_position_acceptance"])
        )
        copied = (r.get("sources") or {}).get("copied") or {}
        if copied.get("steps"):  # proposer ngram / hybrid: how the copied drafts fared beside the drafter's
            drafter = r["sources"]["drafter"]
            Console().print(
                f"  copied drafts: {copied['accepted']}/{copied['drafts']} accepted in {copied['steps']} steps; "
                f"drafter: {drafter['accepted']}/{drafter['drafts']} in {drafter['steps']} steps"
            )
        if r.get("predicted_tau") is not None:  # a drafter with a confidence head: its prediction beside
            Console().print(
                f"  predicted by the confidence head: tau {r['predicted_tau']:.2f}, per position "
                + " ".join(f"{p:.2f}" for p in r["predicted_per_position"])
            )
