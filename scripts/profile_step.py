"""Profile one plain decode step of a target on the CPU: where its time goes, against its floors.

Usage: .venv/bin/python scripts/profile_step.py --target smollm2-135m-instruct [--threads 1] [--rounds 5]
           [--context 100] [--packed auto|on|off] [--out FILE.json]

Measures, interleaved round by round (so a shared machine's load falls on all alike), the process CPU
time and the wall time of:
  step      TargetModel.forward of one token into a cache holding --context tokens, plus its argmax
  gemms     the same linear layers' products alone, in the same order, on one row (the GEMV floor)
  read      one pass over every linear weight (torch.sum per weight: the memory floor of the weights)
and then one step under torch.profiler with record_function per phase (norms, projections, rotary,
cache, attention, MLP, head), reporting per-phase and per-operator time and the number of operator
calls per step. CPU time, not wall time, is the figure to compare on a shared machine: with one
thread it is the work done and the memory stalls, not the waits for a core.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_trt.api import load_target
from dflash_trt.modeling import step_ops
from dflash_trt.modeling.cpu_pack import PackedLinear

PHASES = {  # step_ops function -> phase label
    "rms_norm": "norm",
    "linear": "linear",
    "rope": "rotary",
    "mlp": "mlp (incl. its linears)",
}


@contextmanager
def phase_labels():
    """Wrap step_ops' functions in record_function so the profile groups operators by phase."""
    saved = {name: getattr(step_ops, name) for name in PHASES}

    def wrap(name, fn):
        def run(*a, **k):
            with record_function(f"phase::{PHASES[name]}"):
                return fn(*a, **k)

        return run

    try:
        for name, fn in saved.items():
            setattr(step_ops, name, wrap(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(step_ops, name, fn)


def linears(target) -> list[torch.nn.Module]:
    return [m for m in target.hf.modules() if type(m) in (torch.nn.Linear, PackedLinear)]


def timed(fn) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    fn()
    return (time.process_time() - c) * 1e3, (time.perf_counter() - w) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--packed", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    packed = {"auto": None, "on": True, "off": False}[args.packed]
    target, _ = load_target(args.target, dtype="float32", progress=False, device="cpu", packed=packed)
    mods = linears(target)
    weights_mb = sum(m.in_features * m.out_features * 4 for m in mods) / 1e6
    cache = target.new_cache(1, args.context + 8)
    tok = target.prefill([list(range(1, args.context + 1))], cache).logits[:, -1].argmax(-1)

    def step():
        target.forward(tok[:, None], cache).logits[:, -1].argmax(-1)
        cache.crop(cache.lengths - 1)

    rows = [torch.randn(1, m.in_features) for m in mods]

    def gemms():
        for m, x in zip(mods, rows):
            m(x) if type(m) is PackedLinear else F.linear(x, m.weight)

    dense = [m.weight for m in mods if m.weight is not None]

    def read():
        for w in dense:
            w.sum()

    parts = {"step": step, "gemms": gemms, "read": read}
    for fn in parts.values():  # warm-up
        fn()
    samples = {k: [] for k in parts}
    for _ in range(args.rounds):
        for k, fn in parts.items():
            samples[k].append(timed(fn))
    with phase_labels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ops = sorted((e for e in events if not e.key.startswith("phase::")), key=lambda e: -e.self_cpu_time_total)
    result = {
        "target": args.target,
        "threads": args.threads,
        "context": args.context,
        "packed": target.packed,
        "linear_weights_mb": round(weights_mb, 1),
        "read_covers_mb": round(sum(w.numel() * w.element_size() for w in dense) / 1e6, 1),
        "median_cpu_ms": {k: round(sorted(a for a, _ in v)[len(v) // 2], 1) for k, v in samples.items()},
        "median_wall_ms": {k: round(sorted(b for _, b in v)[len(v) // 2], 1) for k, v in samples.items()},
        "samples_cpu_ms": {k: [round(a, 1) for a, _ in v] for k, v in samples.items()},
        "aten_calls_per_step": sum(e.count for e in events if e.key.startswith("aten::")),
        "profile_total_ms": round(total / 1e3, 1),
        "phases_ms": {
            e.key: round(e.cpu_time_total / 1e3, 2) for e in events if e.key.startswith("phase::")
        },  # inclusive, profiler (wall) time: fractions, not absolute figures, on a shared machine
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in ops[:12]
        ],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
