#!/usr/bin/env python3
"""Where the served engine's time goes under load: py-spy's samples of the engine model's Python-backend
stub (the process that runs the orchestrator and the SpecEngine), sorted into the engine's phases.

    py-spy record -p STUB_PID -r 25 --nonblocking --idle -f raw -o c16.txt   # while a load runs
    python scripts/aiperf_sweep_profile.py c1.txt c16.txt c64.txt            # one column per file

scripts/aiperf_sweep.py --py-spy PROPOSER records these during that proposer's gRPC cells. Shares are
of the engine's step-loop thread (Orchestrator._loop, which runs every prefill and step): each of its
samples goes to the first phase whose marker is on its stack, or to idle when the thread is parked in
a wait (no work). The stub's other threads (Triton's execute, which parses requests, and helpers) are
one extra row: their non-idle samples per step-loop sample, i.e. how much of a core they wanted.
"""

from __future__ import annotations

import sys
from pathlib import Path

# (phase, markers any of which on the stack puts a sample there), checked in this order
PHASES = [
    ("prefill (new rows)", ("add_requests (dflash_trt/decoding/engine.py",)),
    ("verify (target forward)", ("verify (dflash_trt/decoding/engine.py", "verify_round (dflash_trt/decoding/tree.py")),
    ("draft (drafter / copy)", ("propose (dflash_trt/decoding/engine.py",)),
    ("accept + rewind", ("accept (dflash_trt/decoding/engine.py", "rewind (dflash_trt/decoding/engine.py")),
    ("engine bookkeeping", ("dflash_trt/decoding/engine.py",)),
    ("orchestrator + responses", ("dflash_trt/serving/orchestrator.py",)),
]
LOOP = "Orchestrator._loop ("
OTHERS = "other threads busy (per loop sample)"
IDLE_LEAVES = ("wait (threading.py", "_wait_for_tstate_lock", "sleep", "select (", "poll (", "(queue.py", "epoll")


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format, `frame;frame;...;leaf COUNT` per line -> [(frames, count)]."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _idle(frames: list[str]) -> bool:
    return not frames or any(k in frames[-1] for k in IDLE_LEAVES)


def phase_of(frames: list[str]) -> str:
    if _idle(frames):
        return "idle (waiting)"
    joined = ";".join(frames)
    return next((name for name, marks in PHASES if any(m in joined for m in marks)), "other")


def summarize(text: str) -> dict[str, float]:
    """Share of the step loop's samples per phase (they sum to 1), plus OTHERS; {} without loop samples."""
    counts: dict[str, int] = {}
    others = 0
    for frames, n in parse_raw(text):
        if any(LOOP in f for f in frames):
            key = phase_of(frames)
            counts[key] = counts.get(key, 0) + n
        elif not _idle(frames):
            others += n
    total = sum(counts.values())
    return {**{k: v / total for k, v in counts.items()}, OTHERS: others / total} if total else {}


def table(columns: dict[str, dict[str, float]]) -> str:
    names = [p for p, _ in PHASES] + ["idle (waiting)", "other", OTHERS]
    lines = ["| phase | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name in names:
        if any(name in c for c in columns.values()):
            lines.append(f"| {name} | " + " | ".join(f"{c.get(name, 0.0):.0%}" for c in columns.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    files = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not files:
        print(__doc__)
        return 2
    print(table({(f.parent.name if f.stem == "pyspy" else f.stem): summarize(f.read_text()) for f in files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
