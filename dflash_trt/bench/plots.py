"""PNG figures of a bench report (matplotlib, Agg backend; the optional `bench` extra).

Boundary: reads the report dict only. Figures: speedup over `hf` per dataset and method
(speedup.png), the distribution of tokens per target decode pass (acceptance_hist.png),
per-position acceptance (per_position.png), and one per scaling sweep that ran
(scaling_<name>.png). Without matplotlib the plots are skipped with a message, never an error.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        # deferred: optional dependency (the `bench` extra)
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return path


def _speedup(plt, rows: list[dict], path: Path, key: str) -> Path | None:
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if not any(r.get(key) for r in rows):
        return None
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(datasets) * max(1, len(methods)) / 3, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [
            next((r.get(key) or 0.0 for r in rows if r["dataset"] == d and r["method"] == m), 0.0) for d in datasets
        ]
        bars = ax.bar([i + j * width for i in range(len(datasets))], vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel(f"decode speedup over {key.removeprefix('speedup_vs_')}")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _accept_hist(plt, rows: list[dict], path: Path) -> Path | None:
    spec = [r for r in rows if len(r.get("accept_hist") or []) > 2 and r["decode_steps"]]
    if not spec:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(spec)
    for j, r in enumerate(spec):
        h = r["accept_hist"]
        ks = list(range(1, len(h)))
        ax.bar(
            [k + j * width for k in ks],
            [h[k] / r["decode_steps"] for k in ks],
            width,
            label=f"{r['method']} / {r['dataset']} (tau {r['tau']:.2f})",
        )
    ax.set_xlabel("tokens emitted per target decode pass (accepted drafts + bonus)")
    ax.set_ylabel("fraction of decode passes")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _per_position(plt, rows: list[dict], path: Path) -> Path | None:
    spec = [r for r in rows if r.get("per_position_acceptance")]
    if not spec:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in spec:
        p = r["per_position_acceptance"]
        ax.plot(range(1, len(p) + 1), p, marker="o", ms=3, label=f"{r['method']} / {r['dataset']}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft token i accepted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


_SWEEP_AXES = {
    "block_size": ("block_size", "block size", "speedup_vs_baseline", "tau"),
    "prompt_length": ("mean_prompt_tokens", "prompt tokens", "speedup_vs_baseline", "tau"),
    "concurrency": ("concurrency", "concurrent streams", "throughput_tokens_per_s", "tau"),
}


def _sweep(plt, name: str, rows: list[dict], path: Path) -> Path | None:
    if not rows or name not in _SWEEP_AXES:
        return None
    x, xlabel, y1, y2 = _SWEEP_AXES[name]
    xs = [r[x] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r.get(y1) or 0.0 for r in rows], marker="o", color="C0")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(y1.replace("_", " "), color="C0")
    if name != "block_size":
        ax.set_xscale("log", base=2)
    ax2 = ax.twinx()
    ax2.plot(xs, [r.get(y2) or 0.0 for r in rows], marker="s", color="C1")
    ax2.set_ylabel("tau", color="C1")
    ax.set_title(f"scaling: {name.replace('_', ' ')}")
    return _save(plt, fig, path)


def make_plots(rep: dict, out: Path, say=print) -> dict[str, Path]:
    plt = _pyplot()
    if plt is None:
        say("plots skipped: matplotlib is not installed (pip install 'dflash-trt[bench]')")
        return {}
    rows = rep["rows"]
    made = {
        "speedup_plot": _speedup(plt, rows, out / "speedup.png", "speedup_vs_hf")
        or _speedup(plt, rows, out / "speedup.png", "speedup_vs_baseline"),
        "acceptance_hist_plot": _accept_hist(plt, rows, out / "acceptance_hist.png"),
        "per_position_plot": _per_position(plt, rows, out / "per_position.png"),
    }
    for name, sweep in (rep.get("sweeps") or {}).items():
        made[f"scaling_{name}_plot"] = _sweep(plt, name, sweep.get("rows") or [], out / f"scaling_{name}.png")
    return {k: v for k, v in made.items() if v is not None}
