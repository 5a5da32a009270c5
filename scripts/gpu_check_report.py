"""Measuring and reporting for scripts/gpu_check.py: the timer, the byte and error counts, the results
table (one row per kernel case, against the bandwidth bound) and the generate() per-step table.

What is measured, at which shapes and against what, stays in gpu_check.py (and gpu_step_check.py,
gpu_engine_check.py); this module only times a call, counts, and formats. gpu_check.py imports it
from its own folder (scripts/) and re-exports bench, max_err and nbytes for gpu_step_check.py.
No torch or triton import at module level: gpu_check.py sets TRITON_INTERPRET before either loads.
"""

from __future__ import annotations

import time


def bench(fn, dev) -> float:
    """Median microseconds per call (GPU: triton.testing.do_bench, L2 flushed; dry-run: one call)."""
    if dev.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    fn()  # compile / warm up
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


class Report:
    def __init__(self, dev, peak_tbs):
        self.dev, self.peak = dev, peak_tbs * 1e12
        self.rows = []

    def add(self, kernel, shape, t_triton, t_torch, nbytes, err, ok, err_label="max err"):
        bound_us = nbytes / self.peak * 1e6
        self.rows.append(
            dict(
                kernel=kernel,
                shape=shape,
                triton_us=t_triton,
                torch_us=t_torch,
                speedup=t_torch / t_triton,
                bytes=nbytes,
                bound_us=bound_us,
                pct_of_bound=100 * bound_us / t_triton,
                max_err=err,
                err_label=err_label,
                ok=ok,
            )
        )
        r = self.rows[-1]
        print(
            f"  {kernel:24s} {shape:34s} {t_triton:10.1f} {t_torch:10.1f} {r['speedup']:7.2f}x "
            f"{r['pct_of_bound']:6.1f}%  {'ok' if ok else 'MISMATCH'} ({err:.2g})",
            flush=True,
        )

    def table(self) -> str:
        head = ["kernel", "shape", "triton us", "torch us", "speedup", "% of BW bound", "check vs reference"]
        lines = [
            [
                r["kernel"],
                r["shape"],
                f"{r['triton_us']:.1f}",
                f"{r['torch_us']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r['pct_of_bound']:.1f}%",
                f"{'ok' if r['ok'] else 'MISMATCH'} ({r['err_label']} {r['max_err']:.2g})",
            ]
            for r in self.rows
        ]
        w = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        fmt = lambda row: "| " + " | ".join(str(x).ljust(n) for x, n in zip(row, w)) + " |"  # noqa: E731
        return "\n".join([fmt(head), "|" + "|".join("-" * (n + 2) for n in w) + "|", *map(fmt, lines)])


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def print_loop_table(loop) -> None:
    """The `loop` section's rows (gpu_engine_check.loop_timing) as a markdown table on stdout."""
    print("\ngenerate() per verify step, random Qwen3-0.6B-shaped target (bf16), 5-layer B=16 drafter:")
    print(
        "| rows | prompt | torch ms | triton ms | triton + CUDA graph ms | target alone ms/token "
        "| HF generate() ms/token | paths agree |"
    )
    print(
        "|------|--------|----------|-----------|------------------------|-----------------------"
        "|------------------------|-------------|"
    )
    for r in loop:
        m = r["ms_per_step"]
        print(
            f"| {r['rows']} | {r['prompt_len']} | {m['torch']} | {m['triton']} | {m['triton+graph']} | "
            f"{r['baseline_ms_per_token']} | {r['hf_generate_ms_per_token']} | {r['dflash_paths_agree']} |"
        )
