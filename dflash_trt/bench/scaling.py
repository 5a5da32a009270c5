"""Scaling runs: speedup and tau of DFlash against block size, prompt length, and (through the
Triton server) the number of concurrent streams.

Boundary: schedules and per-sweep aggregation; each sweep reuses schedule.py's interleaving (for every
prompt, the baseline then each DFlash variant) and report's `summarize`. Prompts come from the
bench's first dataset. A sweep that cannot run (no drafter, no server, prompt longer than the
target's context) is reported with the reason instead of failing the bench.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from dflash_trt.bench.methods import Baseline, DFlash, Item, Method, MethodUnavailable
from dflash_trt.bench.report import summarize
from dflash_trt.bench.schedule import fit_prompt, run_schedule
from dflash_trt.decoding.stats import DecodeStats


def _speedup_rows(records: list[dict], label: str, values: list, baseline_name: str = "baseline") -> list[dict]:
    base = summarize([r["run"] for r in records if r["method"] == baseline_name])
    rows = []
    for v in values:
        s = summarize([r["run"] for r in records if r["method"] == f"dflash@{v}"])
        s.update(
            {
                label: v,
                "baseline_tokens_per_s": base["decode_tokens_per_s"],
                "speedup_vs_baseline": (
                    s["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base["decode_tokens_per_s"] else None
                ),
            }
        )
        rows.append(s)
    return rows


def _baseline(ctx, methods: dict) -> Method:
    if "baseline" in methods:
        return methods["baseline"]
    return Baseline(ctx)


def _dflash_at(ctx, block_size: int | None) -> DFlash:
    m = DFlash(ctx)
    m.block_size = block_size
    m.prepare()
    return m


def sweep_block_sizes(
    ctx, items: list[Item], params, sizes: list[int], methods: dict, mismatches: list[str], say=print
) -> dict:
    try:
        variants = {f"dflash@{b}": _dflash_at(ctx, b) for b in sizes}
    except MethodUnavailable as e:
        return {"skipped": str(e)}
    schedule = {"baseline": _baseline(ctx, methods), **variants}
    records = run_schedule(schedule, items, params, "baseline", ctx, mismatches, say=say)
    say(f"scaling: block sizes {sizes} done")
    return {"rows": _speedup_rows(records, "block_size", sizes)}


def sweep_prompt_lengths(
    ctx, items: list[Item], params, lengths: list[int], methods: dict, mismatches: list[str], say=print
) -> dict:
    try:
        dflash = _dflash_at(ctx, None)
    except MethodUnavailable as e:
        return {"skipped": str(e)}
    base = _baseline(ctx, methods)
    limit = ctx.target.max_context() - params.max_new_tokens - 2 * dflash.drafter.block_size - 1
    rows, notes = [], []
    for L in lengths:
        if L > limit:
            notes.append(
                f"length {L} skipped: with {params.max_new_tokens} new tokens it exceeds the target's "
                f"context ({ctx.target.max_context()})"
            )
            continue
        fitted = []
        for i, it in enumerate(items):
            filler = "\n\n".join(o.text for j, o in enumerate(items) if j != i) or it.text
            text, ids = fit_prompt(ctx.tokenizer, it.text, ctx.chat, L, filler=filler)
            fitted.append(Item(it.dataset, it.id, text, ids[:limit]))
        records = run_schedule(
            {"baseline": base, f"dflash@{L}": dflash}, fitted, params, "baseline", ctx, mismatches, say=say
        )
        row = _speedup_rows(records, "target_length", [L])[0]
        row["mean_prompt_tokens"] = sum(len(f.ids) for f in fitted) / len(fitted)
        rows.append(row)
        say(f"scaling: prompt length {L} done (speedup {row['speedup_vs_baseline'] or 0:.2f}x)")
    out = {"rows": rows}
    if notes:
        out["skipped"] = "; ".join(notes)
    return out


def sweep_concurrency(
    triton, items: list[Item], params, levels: list[int], baseline_tps: float | None, say=print
) -> dict:
    """Aggregate throughput with `c` concurrent gRPC streams (each its own connection)."""
    kw = triton.request_kwargs(params)
    rows = []
    single = None
    for c in levels:
        texts = [items[i % len(items)].text for i in range(max(c, len(items)))]

        def one(text):
            t0 = time.perf_counter()
            r = triton.client.stream_text(text, params.max_new_tokens, **kw)
            return r, time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=c) as ex:
            results = list(ex.map(one, texts))
        wall = time.perf_counter() - t0
        toks = sum(int(r.get("num_output_tokens") or 0) for r, _ in results)
        perf = [r.get("perf_metrics") or {} for r, _ in results]
        st = DecodeStats()  # the requests' accept histograms added: tau as decoding/stats.py defines it
        for p in perf:
            st.add(DecodeStats.from_hist(p.get("accept_hist") or []))
        row = {
            "concurrency": c,
            "requests": len(texts),
            "throughput_tokens_per_s": toks / wall,
            "mean_latency_s": sum(dt for _, dt in results) / len(results),
            "ttft_ms": 1e3 * sum(p.get("time_to_first_token") or 0.0 for p in perf) / len(perf),
            "tau": st.tau if st.num_verify_steps else None,
        }
        single = single or (row["throughput_tokens_per_s"] if c == 1 else None)
        row["speedup_vs_single_stream"] = row["throughput_tokens_per_s"] / single if single else None
        row["speedup_vs_baseline"] = row["throughput_tokens_per_s"] / baseline_tps if baseline_tps else None
        rows.append(row)
        say(f"scaling: {c} concurrent streams: {row['throughput_tokens_per_s']:.1f} tok/s")
    return {"rows": rows}


def run_sweeps(
    ctx, cfg, methods: dict, items: dict[str, list[Item]], params, records: list[dict], mismatches: list[str], say=print
) -> dict:
    """The sweeps cfg asks for; at temperature 0 every DFlash variant must match the baseline exactly
    (differences are appended to `mismatches`)."""
    if not (cfg.sweep_block_sizes or cfg.sweep_prompt_lengths or cfg.sweep_concurrency):
        return {}
    first = next(iter(items.values()))
    out = {}
    if cfg.sweep_block_sizes:
        out["block_size"] = sweep_block_sizes(ctx, first, params, cfg.sweep_block_sizes, methods, mismatches, say)
    if cfg.sweep_prompt_lengths:
        out["prompt_length"] = sweep_prompt_lengths(
            ctx, first, params, cfg.sweep_prompt_lengths, methods, mismatches, say
        )
    if cfg.sweep_concurrency:
        if "dflash-triton" not in methods:
            out["concurrency"] = {
                "skipped": "needs the dflash-triton method (add it to --methods; serving must " "be available)"
            }
        else:
            base = [r for r in records if r["method"] == "baseline" and r["dataset"] == first[0].dataset]
            tps = summarize([r["run"] for r in base])["decode_tokens_per_s"] if base else None
            out["concurrency"] = sweep_concurrency(
                methods["dflash-triton"], first, params, cfg.sweep_concurrency, tps, say
            )
    return out
