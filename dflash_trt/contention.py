"""How much of the machine other processes used while we were timing something.

Boundary: Linux only (/proc/stat); elsewhere `CpuWatch.others_share` is None and nothing is said.
Used by the timings of quickstart, eval and bench (its main interleaved schedule; no figure when
the dflash-triton method runs, since the Triton server is another process and would count as "other").

Why: a speedup measured next to another CPU-heavy job is not DFlash's. On a 2-core machine with a
feature precompute running, the quickstart measured 0.48x instead of 1.30x with the same drafter:
a verify pass over a block is a multi-threaded GEMM that loses more to a competing process than a
1-token decode step does, so contention biases the ratio, not only the absolute speed. Interleaving
(A B A B) cannot correct that; the user has to know.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

WARN_SHARE = 0.25  # other processes' share of all CPU time above which a timing is flagged


def _machine_busy_s() -> float | None:
    """CPU-seconds all CPUs spent busy since boot (everything but idle and iowait), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4] - ticks[7]  # steal is time another VM had: not ours to see
    return busy / os.sysconf("SC_CLK_TCK")


def _snapshot() -> tuple[float | None, float, float]:
    """(machine busy CPU-s, this process's CPU-s over all its threads, wall-clock s)."""
    return _machine_busy_s(), time.process_time(), time.perf_counter()


def _children_s() -> float:
    """CPU-s of this process's children that have ended and been waited for (a server started and stopped)."""
    t = os.times()
    return t.children_user + t.children_system


class CpuWatch:
    """with CpuWatch() as w: ...timed work...; then w.others_share is the fraction of the machine's
    CPU capacity (all cores) that processes other than this one used meanwhile. children=True counts
    this process's children as its own (they must have ended and been waited for inside the block)."""

    def __init__(self, cpus: int | None = None, children: bool = False):
        self.cpus = cpus or os.cpu_count() or 1
        self.children = children
        self.others_share: float | None = None

    def __enter__(self) -> CpuWatch:
        self._start, self._kids = _snapshot(), (_children_s() if self.children else 0.0)
        return self

    def __exit__(self, *exc) -> None:
        (busy0, own0, t0), (busy1, own1, t1) = self._start, _snapshot()
        own1 += (_children_s() if self.children else 0.0) - self._kids
        wall = t1 - t0
        if busy0 is None or busy1 is None or wall <= 0:
            return
        others = max(0.0, (busy1 - busy0) - (own1 - own0))
        self.others_share = min(1.0, others / (wall * self.cpus))


def contention_warning(share: float | None) -> str | None:
    """One line for the user when a timing ran on a busy machine, else None."""
    if share is None or share <= WARN_SHARE:
        return None
    return (
        f"warning: other processes used {share:.0%} of this machine's CPU time while timing; the speedup "
        f"above is not reliable (a verify pass loses more to contention than a decode step). "
        f"Run again on an idle machine."
    )
