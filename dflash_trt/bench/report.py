"""Aggregate bench records into per-(dataset, method) rows and write them: bench.json, bench.md,
a rich table on the terminal, and (plots.py) PNG figures.

Boundary: numbers and files only; nothing here runs a model except `sample_divergence`, which
scores sampled outputs under the target (one teacher-forced forward per output).

Definitions (per dataset and method, summed over prompts):
  decode tok/s      (output tokens - 1) / (wall - time to first token)
  speedup           decode tok/s over that of `hf` / of `baseline` on the same prompts
  tau               tokens emitted per target decode pass, bonus token included (passes after
                    the one that produced the first token); 1 for plain decoding
  drafts/step       draft tokens the target judged per decode pass (B-1, or fewer with --draft-cutoff)
  P(accept i)       fraction of decode passes whose i-th drafted token was accepted
  predicted         drafters with a confidence head (DSpark): its mean predicted P(accept i)
                    (predicted_per_position) and the tau it implies (predicted_tau), beside the
                    measured ones (decoding/stats.py); None for every other method
  sources           ours (dflash, ngram, hybrid, tree, dflash-triton): decode passes, drafts judged and drafts
                    accepted per draft source, "drafter" or "copied" from the prompt's own text
                    (decoding/stats.py DecodeStats.sources); the table shows accepted/drafts of each
  draft/verify      seconds per decode pass drafting / in the target's verify forward
  bound             tau * t_target_step / (t_draft + t_verify): the speedup if nothing but
                    drafting and verifying cost time, t_target_step being the baseline's (else
                    hf's) seconds per decoded token; `reached` = measured speedup / bound
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
from collections import Counter
from pathlib import Path

import torch

from dflash_trt.bench.plots import make_plots
from dflash_trt.decoding.stats import DecodeStats, add_lists


def summarize(runs) -> dict:
    dec_tokens = sum(max(0, r.num_output_tokens - 1) for r in runs)
    dec_time = sum(max(0.0, r.wall - r.ttft) for r in runs)
    width = max((len(r.accept_hist) for r in runs), default=0)
    hist = [sum(r.accept_hist[k] for r in runs if k < len(r.accept_hist)) for k in range(width)]
    judged = [r.drafts_verified for r in runs if getattr(r, "drafts_verified", None) is not None]
    st = DecodeStats.from_hist(hist, sum(judged))  # tau and per-position acceptance: decoding/stats.py
    for r in runs:  # the confidence head's summed predictions, where the drafter has one
        st.predicted_at = add_lists(st.predicted_at, getattr(r, "predicted_at", None) or [])
    steps = st.num_verify_steps
    sources = _add_sources([getattr(r, "sources", None) for r in runs])
    draft, verify = sum(r.draft_time for r in runs), sum(r.verify_time for r in runs)
    return {
        "prompts": len(runs),
        "output_tokens": sum(r.num_output_tokens for r in runs),
        "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 else 0.0,
        "ttft_ms": 1e3 * sum(r.ttft for r in runs) / max(1, len(runs)),
        "tau": st.tau if steps else None,
        "accept_hist": hist,
        "drafts_per_step": st.drafts_per_step if judged and steps else None,
        "per_position_acceptance": st.per_position_acceptance,
        "predicted_per_position": st.predicted_per_position or None,
        "predicted_tau": st.predicted_tau,
        "decode_steps": steps,
        "sources": sources,
        "draft_ms_per_step": 1e3 * draft / steps if steps else None,
        "verify_ms_per_step": 1e3 * verify / steps if steps else None,
    }


def _add_sources(per_run: list[dict | None]) -> dict | None:
    """The runs' per-source counts summed ({source: {steps, drafts, accepted}}); None if no run has them."""
    given = [s for s in per_run if s]
    if not given:
        return None
    out: dict[str, dict[str, int]] = {}
    for s in given:
        for src, counts in s.items():
            acc = out.setdefault(src, {})
            for k, v in counts.items():
                acc[k] = acc.get(k, 0) + int(v)
    return out


def aggregate(records: list[dict], methods: list[str]) -> list[dict]:
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    groups = [(d, [r for r in records if r["dataset"] == d]) for d in datasets]
    if len(datasets) > 1:
        groups.append(("all", records))
    rows = []
    for ds, recs in groups:
        by = {m: [r for r in recs if r["method"] == m] for m in methods}
        stats = {m: summarize([r["run"] for r in rs]) for m, rs in by.items() if rs}
        for m, s in stats.items():
            row = {"dataset": ds, "method": m, **s, "mismatches": sum(1 for r in by[m] if r.get("mismatch"))}
            for ref in ("hf", "baseline"):
                base = stats.get(ref, {}).get("decode_tokens_per_s")
                row[f"speedup_vs_{ref}"] = s["decode_tokens_per_s"] / base if base else None
            ref = "baseline" if "baseline" in stats else ("hf" if "hf" in stats else None)
            row["bound"] = row["bound_reached"] = None
            step = (s["draft_ms_per_step"] or 0.0) + (s["verify_ms_per_step"] or 0.0)
            if ref and s["tau"] and step > 0 and stats[ref]["decode_tokens_per_s"]:
                t_target_ms = 1e3 / stats[ref]["decode_tokens_per_s"]
                row["bound"] = s["tau"] * t_target_ms / step
                sp = row[f"speedup_vs_{ref}"]
                row["bound_reached"] = sp / row["bound"] if sp else None
            rows.append(row)
    return rows


def sample_divergence(ctx, records: list[dict], reference: str | None) -> dict:
    """At temperature > 0: mean log-probability (at that temperature) of each method's sampled
    tokens under the target, and the Jensen-Shannon divergence of its output-token frequencies
    from the reference method's. Lossless samplers match the reference up to sampling noise."""
    T = ctx.cfg.temperature
    lp: dict[str, list[float]] = {}
    freq: dict[str, Counter] = {}
    for r in records:
        run, item = r["run"], r["item"]
        toks = (
            run.tokens
            if run.tokens is not None
            else ctx.tokenizer(run.text or "", add_special_tokens=False)["input_ids"]
        )
        freq.setdefault(r["method"], Counter()).update(toks)
        if not toks:
            continue
        ids = torch.tensor([item.ids + toks], device=ctx.device)
        with torch.no_grad():
            logits = ctx.target.hf(input_ids=ids).logits[0, len(item.ids) - 1 : -1].float() / T
        got = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks, device=ctx.device)[:, None])
        lp.setdefault(r["method"], []).extend(got.squeeze(-1).tolist())
    out = {}
    for m, f in freq.items():
        vals = lp.get(m, [])
        mean = sum(vals) / len(vals) if vals else None
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(1, len(vals) - 1)) if vals else None
        out[m] = {
            "tokens": len(vals),
            "mean_logprob": mean,
            "stderr": sd / math.sqrt(len(vals)) if vals else None,
            "js_divergence_vs_reference": js_divergence(f, freq[reference]) if reference in freq else None,
        }
    ref = out.get(reference)
    for s in out.values():  # difference of mean log-probs in standard errors (|z| > 3: suspicious)
        se = math.hypot(s["stderr"] or 0.0, ref["stderr"] or 0.0) if ref and ref["mean_logprob"] is not None else 0
        s["z_vs_reference"] = (
            (s["mean_logprob"] - ref["mean_logprob"]) / se if se and s["mean_logprob"] is not None else None
        )
    return out


def js_divergence(a: Counter, b: Counter) -> float:
    """Jensen-Shannon divergence (bits) between two token-frequency counters."""
    na, nb = sum(a.values()) or 1, sum(b.values()) or 1
    js = 0.0
    for t in set(a) | set(b):
        p, q = a[t] / na, b[t] / nb
        m = (p + q) / 2
        js += 0.5 * (p * math.log2(p / m) if p else 0.0) + 0.5 * (q * math.log2(q / m) if q else 0.0)
    return js


def build_report(
    cfg, ctx, records, methods, skipped, reference, mismatches, sampling, sweeps, lossless: set[str] | None = None
) -> dict:
    # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
    import transformers

    greedy = cfg.temperature == 0
    rows = aggregate(records, methods)
    for row in rows:
        checked = greedy and reference and (lossless is None or row["method"] in lossless)
        row["exact"] = (
            "reference" if row["method"] == reference else ("NO" if row["mismatches"] else "yes") if checked else None
        )
    per_prompt = [
        {
            "dataset": r["dataset"],
            "prompt": r["prompt"],
            "method": r["method"],
            "prompt_tokens": r["prompt_tokens"],
            "output_tokens": r["run"].num_output_tokens,
            "ttft_s": r["run"].ttft,
            "wall_s": r["run"].wall,
            "accept_hist": r["run"].accept_hist,
            **({"predicted_at": r["run"].predicted_at} if getattr(r["run"], "predicted_at", None) else {}),
            **({"sources": r["run"].sources} if getattr(r["run"], "sources", None) else {}),
            **({"mismatch": r["mismatch"]} if r.get("mismatch") else {}),
        }
        for r in records
    ]
    return {
        "config": dataclasses.asdict(cfg),
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(ctx.device),
            "dtype": str(ctx.target.dtype),
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if ctx.device.type == "cuda" else None,
            "machine": platform.machine(),
            "target_path": str(ctx.target_path),
        },
        "reference": reference,
        "methods": methods,
        "skipped": skipped,
        "rows": rows,
        "mismatches": mismatches,
        "sampling": sampling,
        "sweeps": sweeps,
        "per_prompt": per_prompt,
    }


# ---- rendering -------------------------------------------------------------------------------
COLUMNS = [
    ("dataset", "dataset"),
    ("method", "method"),
    ("decode_tokens_per_s", "tok/s"),
    ("speedup_vs_hf", "vs hf"),
    ("speedup_vs_baseline", "vs baseline"),
    ("ttft_ms", "TTFT ms"),
    ("tau", "tau"),
    ("drafts_per_step", "drafts/step"),
    ("per_position_acceptance", "P(accept) pos 1..8"),
    ("predicted_tau", "pred. tau"),
    ("predicted_per_position", "pred. P(accept) 1..8"),
    ("sources.drafter", "drafter acc/drafts"),
    ("sources.copied", "copied acc/drafts"),
    ("draft_ms_per_step", "draft ms/step"),
    ("verify_ms_per_step", "verify ms/step"),
    ("bound", "bound"),
    ("bound_reached", "reached"),
    ("exact", "exact"),
]


def fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key.startswith("sources."):  # one draft source's {steps, drafts, accepted}
        return f"{v['accepted']}/{v['drafts']}" if v.get("steps") else "-"
    if key in ("per_position_acceptance", "predicted_per_position"):
        return " ".join(f"{p:.2f}" for p in v[:8]) or "-"
    if key.startswith("speedup") or key == "bound":
        return f"{v:.2f}x"
    if key == "bound_reached":
        return f"{100 * v:.0f}%"
    if isinstance(v, float):
        return f"{v:.2f}" if key in ("tau", "predicted_tau") else f"{v:.3f}" if key == "mean_latency_s" else f"{v:.1f}"
    return str(v)


def cell(row: dict, key: str):
    """row[key]; a dotted key looks inside a nested dict (sources.copied = row["sources"]["copied"])."""
    head, _, rest = key.partition(".")
    v = row.get(head)
    return (v or {}).get(rest) if rest else v


def table_rows(rows: list[dict], columns=COLUMNS) -> list[list[str]]:
    return [[fmt(k, cell(r, k)) for k, _ in columns] for r in rows]


def markdown(rows: list[dict], columns=COLUMNS) -> str:
    head = "| " + " | ".join(t for _, t in columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(c) + " |\n" for c in table_rows(rows, columns))


SWEEP_COLUMNS = {
    "block_size": [
        ("block_size", "block"),
        ("decode_tokens_per_s", "tok/s"),
        ("speedup_vs_baseline", "vs baseline"),
        ("tau", "tau"),
        ("per_position_acceptance", "P(accept) pos 1..8"),
    ],
    "prompt_length": [
        ("target_length", "target len"),
        ("mean_prompt_tokens", "prompt tokens"),
        ("baseline_tokens_per_s", "baseline tok/s"),
        ("decode_tokens_per_s", "dflash tok/s"),
        ("speedup_vs_baseline", "vs baseline"),
        ("tau", "tau"),
        ("ttft_ms", "TTFT ms"),
    ],
    "concurrency": [
        ("concurrency", "streams"),
        ("requests", "requests"),
        ("throughput_tokens_per_s", "tok/s"),
        ("mean_latency_s", "latency s"),
        ("ttft_ms", "server TTFT ms"),
        ("tau", "tau"),
        ("speedup_vs_single_stream", "vs 1 stream"),
        ("speedup_vs_baseline", "vs baseline"),
    ],
}


def render_markdown(rep: dict) -> str:
    cfg = rep["config"]
    env = rep["environment"]
    lines = [
        f"# DFlash benchmark: {Path(cfg['target']).name}",
        "",
        f"device {env['device']} ({env['cuda'] or env['machine']}), {env['dtype']}, torch {env['torch']}, "
        f"transformers {env['transformers']}; temperature {cfg['temperature']}, max_new_tokens "
        f"{cfg['max_new_tokens']}, chat {'on' if cfg['chat'] else 'off'}, reference `{rep['reference']}`"
        + (f", dflash draft cutoff {cfg['draft_cutoff']:g}" if cfg.get("draft_cutoff") else "")
        + (f", draft length {cfg['draft_length']}" if cfg.get("draft_length", "block") != "block" else "")
        + (f", served proposer {cfg['proposer']}" if cfg.get("proposer", "dflash") != "dflash" else ""),
        "",
        markdown(rep["rows"]),
    ]
    for name, why in rep["skipped"].items():
        lines.append(f"- skipped `{name}`: {why}")
    if rep["mismatches"]:
        lines += ["", "## Output mismatches (greedy)", ""] + [f"- {m}" for m in rep["mismatches"]]
    if rep.get("sampling"):
        lines += [
            "",
            "## Sampling comparison (temperature > 0: distributions, not tokens)",
            "",
            "Mean log-probability of the sampled tokens under the target at this temperature (equal in "
            "expectation for lossless samplers; z = difference from the reference in standard errors), and the "
            "Jensen-Shannon divergence (bits) of output-token frequencies from the reference's (sampling noise "
            "dominates it on small samples).",
            "",
            "| method | tokens | mean log-prob | stderr | z vs ref | JS div vs ref |",
            "|---|---|---|---|---|---|",
        ]
        for m, s in rep["sampling"].items():
            cells = [
                f"{v:.3f}" if isinstance(v, float) else "-"
                for v in (s["mean_logprob"], s["stderr"], s.get("z_vs_reference"), s["js_divergence_vs_reference"])
            ]
            lines.append(f"| {m} | {s['tokens']} | " + " | ".join(cells) + " |")
    for name, sweep in (rep.get("sweeps") or {}).items():
        lines += ["", f"## Scaling: {name.replace('_', ' ')}", ""]
        if sweep.get("skipped"):
            lines.append(f"skipped: {sweep['skipped']}")
        if sweep.get("rows"):
            lines.append(markdown(sweep["rows"], SWEEP_COLUMNS[name]))
    return "\n".join(lines) + "\n"


def print_rich(rep: dict) -> None:
    # deferred: rich takes ~0.1 s to import, and `dflash-trt --help` imports this module
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True)
    if not con.is_terminal:
        con = Console(stderr=True, width=200)
    t = Table(title=f"DFlash benchmark ({rep['environment']['device']}, T={rep['config']['temperature']})")
    for _, title in COLUMNS:
        t.add_column(
            title,
            justify="left" if title in ("dataset", "method", "P(accept) pos 1..8", "pred. P(accept) 1..8") else "right",
        )
    for r, cells in zip(rep["rows"], table_rows(rep["rows"])):
        t.add_row(*cells, style="bold red" if r["mismatches"] else None)
    con.print(t)
    for name, sweep in (rep.get("sweeps") or {}).items():
        if sweep.get("rows"):
            st = Table(title=f"scaling: {name.replace('_', ' ')}")
            for _, title in SWEEP_COLUMNS[name]:
                st.add_column(title, justify="right")
            for cells in table_rows(sweep["rows"], SWEEP_COLUMNS[name]):
                st.add_row(*cells)
            con.print(st)


def write_outputs(rep: dict, out: Path, plots: bool = True, say=print) -> dict[str, Path]:
    files = {"json": out / "bench.json", "markdown": out / "bench.md"}
    files["json"].write_text(json.dumps(rep, indent=2, default=str) + "\n")
    files["markdown"].write_text(render_markdown(rep))
    print_rich(rep)
    if plots:
        made = make_plots(rep, out, say=say)
        files.update(made)
    rep["files"] = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(rep, indent=2, default=str) + "\n")
    say(f"wrote {', '.join(str(p) for p in files.values())}")
    return files
