"""FP8 vs bf16 target step time on a GPU (scripts/gpu_check.sh step 3): the torch engine's native FP8 linears
(modeling/lowp_linear.py) against the same layers in bf16, at Qwen3-8B's decoder-layer shapes.

Prints one table (ms per layer forward for a decode step of B rows and a verify block of 16 tokens);
--dry-run checks the script on CPU without timing FP8 (it has no FP8 GEMMs there).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from dflash_trt.deploy import formats as F
from dflash_trt.modeling.lowp_linear import FP8Linear, native_fp8_reason

# Qwen3-8B: hidden 4096, q 4096, kv 1024, intermediate 12288 -> the seven linears of a decoder layer
SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]


def layer(fp8: bool, device, scale: int = 1) -> list[nn.Module]:
    mods = []
    for out_f, in_f in SHAPES:
        out_f, in_f = out_f // scale, in_f // scale
        w = torch.randn(out_f, in_f, device=device) * 0.02
        if fp8:
            ws = F.fp8_scale(w)
            mods.append(FP8Linear(F.fp8_quantize(w, ws), ws, torch.tensor(0.01, device=device)))
        else:
            lin = nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16)
            mods.append(lin)
    return mods


def step_ms(mods, tokens: int, device, reps: int) -> float:
    xs = {m.in_features: torch.randn(tokens, m.in_features, device=device, dtype=torch.bfloat16) for m in mods}
    with torch.no_grad():
        for _ in range(3):
            [m(xs[m.in_features]) for m in mods]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            [m(xs[m.in_features]) for m in mods]
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device("cpu" if a.dry_run else "cuda")
    why = native_fp8_reason(device)
    if why and not a.dry_run:
        raise SystemExit(f"gpu_fp8_step: {why}")
    rows = []
    for tokens in (1, 8, 16 * 8, 16 * 32):  # decode rows / verify blocks of 16 tokens for 8 and 32 rows
        bf16 = step_ms(layer(False, device, 8 if a.dry_run else 1), tokens, device, 2 if a.dry_run else 50)
        fp8 = None if why else step_ms(layer(True, device), tokens, device, 50)
        rows.append({"tokens": tokens, "bf16_ms": round(bf16, 4), "fp8_ms": fp8 and round(fp8, 4)})
        ratio = f"{bf16 / fp8:.2f}x" if fp8 else f"n/a ({why})"
        print(f"tokens {tokens:4d}: bf16 {bf16:8.3f} ms  fp8 {fp8 or float('nan'):8.3f} ms  speedup {ratio}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": str(device), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
