"""Time the DFlash Triton kernels on a GPU against the engine's PyTorch path and the bandwidth bound.

    python scripts/gpu_check.py              # on a CUDA GPU (scripts/gpu_check.sh runs the tests first)
    python scripts/gpu_check.py --dry-run    # same code path on CPU in Triton's interpreter, tiny shapes

For every case: the Triton launcher's time, the time of what the PyTorch engine does instead
(modeling/drafter.py's per-layer projections + cache writes, its masked SDPA over the cache with
GQA repeat, decoding/verify.py's acceptance), the speedup, and the share of the memory-bandwidth
bound reached: (minimum bytes the op must move: every input read once, every output written
once) / peak bandwidth, divided by the kernel's time. Every kernel output is also checked
against dflash_trt/kernels/reference.py (or decoding/verify.py) at the same shape. A last section
runs generate() with kernels="triton" and "torch" on a tiny random model (needs transformers)
and checks the tokens are identical, and times one whole drafter step at the real shape, eager
and replayed from a CUDA graph (modeling/cuda_graph.py). On a GPU, `loop` times generate() per verify
step on a random Qwen3-0.6B-shaped target: eager PyTorch, Triton kernels, kernels + CUDA graph.

Shapes are those of a Qwen3-8B DFlash drafter: hidden 4096, 32 heads, 8 kv heads, head_dim 128,
5 layers, block 16, bf16, vocabulary 151936; contexts 1K-8K; batch 1-32.
Output: one table on stdout; JSON to $OUT/gpu_check.json when $OUT is set (or --json FILE).
--dry-run times are CPU-interpreter times of tiny shapes: they prove the script, not the kernels.
The timer and the tables: scripts/gpu_check_report.py (bench, max_err, nbytes re-exported from here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
else:
    os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, also when not pip-installed
if str(Path(__file__).resolve().parent) not in sys.path:  # scripts/ (the siblings), when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_check_report import Report, bench, max_err, nbytes, print_loop_table  # noqa: E402

PEAK_TBS = {"H200": 4.8, "H100": 3.35, "H20": 4.0, "B200": 8.0, "B300": 8.0, "GB200": 8.0, "A100": 2.0}

# ---- shapes -----------------------------------------------------------------------------------
REAL = dict(d=4096, H=32, HKV=8, D=128, L=5, B=16, V=151936, dtype=torch.bfloat16)
TINY = dict(d=64, H=4, HKV=2, D=32, L=2, B=4, V=300, dtype=torch.float32)
REAL_CASES = dict(
    inject=[(1, 16, 4096), (16, 16, 4096), (32, 16, 8192), (1, 2048, 4096)],  # (rows, new tokens, cache slots)
    attention=[(1, 1024), (1, 8192), (16, 4096), (32, 8192)],  # (rows, context)
    greedy=[1, 32],  # rows
    rejection=[1, 32],
    step=[(1, 4096), (16, 4096)],  # whole drafter step (rows, context)
)
TINY_CASES = dict(
    inject=[(1, 4, 24), (3, 5, 24)], attention=[(1, 0), (3, 20)], greedy=[1, 3], rejection=[1, 3], step=[(2, 12)]
)


# ---- the engine's PyTorch path, per op ----------------------------------------------------------
def rms(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_inject(h, positions, wk, wv, knw, inv_freq, cache):
    """modeling/drafter.py inject_context after fuse(): per layer k_proj, k_norm, RoPE, v_proj, cache writes."""
    from dflash_trt.modeling.target import apply_rope

    R, n, _ = h.shape
    D = knw.shape[-1]
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
    for layer in range(wk.shape[0]):
        k = rms((h @ wk[layer].T).view(R, n, -1, D), knw[layer]).transpose(1, 2)
        v = (h @ wv[layer].T).view(R, n, -1, D).transpose(1, 2)
        cache.write(layer, apply_rope(k, cos, sin), v, positions)


def torch_attention(q, kb, vb, cache, positions):
    """modeling/drafter.py draft_block, one layer: write the block into the cache, masked SDPA (GQA repeat)."""
    from dflash_trt.modeling.target import cached_attention

    R, B = positions.shape
    upto = int(positions.max()) + 1
    visible = (torch.arange(upto, device=q.device)[None, :] < (cache.lengths + B)[:, None])[:, None, :]
    cache.write(0, kb, vb, positions)
    k, v = cache.view(0, upto)
    return cached_attention(q, k, v, visible.expand(R, B, upto), q.shape[-1] ** -0.5)


# ---- cases ------------------------------------------------------------------------------------
def tol(dtype) -> float:
    return 2e-4 if dtype == torch.float32 else 6e-2


def run_inject(rep, cfg, cases, dev, g):
    from dflash_trt.kernels import kv_inject
    from dflash_trt.kernels.reference import kv_inject_ref, rope_inv_freq
    from dflash_trt.modeling.cache import KVCache

    d, HKV, D, L, dt = cfg["d"], cfg["HKV"], cfg["D"], cfg["L"], cfg["dtype"]
    wk = (torch.randn(L, HKV * D, d, generator=g, device=dev) * d**-0.5).to(dt)
    wv = (torch.randn(L, HKV * D, d, generator=g, device=dev) * d**-0.5).to(dt)
    knw = (torch.rand(L, D, generator=g, device=dev) + 0.5).to(dt)
    inv_freq = rope_inv_freq(D, 1e6).to(dev)
    for R, n, S in cases:
        h = torch.randn(R, n, d, generator=g, device=dev).to(dt)
        start = torch.randint(0, S - n + 1, (R, 1), generator=g, device=dev)
        pos = start + torch.arange(n, device=dev)
        n_new = torch.full((R,), n, device=dev)
        kc = torch.zeros(L, R, HKV, S, D, dtype=dt, device=dev)
        vc = torch.zeros_like(kc)
        t_tri = bench(lambda: kv_inject(h, pos, n_new, wk, wv, knw, inv_freq, kc, vc), dev)
        cache = KVCache(L, R, HKV, D, S, dt, dev)
        t_torch = bench(lambda: torch_inject(h, pos, wk, wv, knw, inv_freq, cache), dev)
        kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
        kv_inject_ref(h, pos, n_new, wk, wv, knw, inv_freq, kr, vr)
        err = max(max_err(kc, kr), max_err(vc, vr))
        moved = nbytes(h, wk, wv, knw, pos) + 2 * L * R * n * HKV * D * kc.element_size()
        rep.add(
            "kv_inject",
            f"R={R} new={n} L={L} d={d} Hkv={HKV} D={D}",
            t_tri,
            t_torch,
            moved,
            err,
            err <= tol(dt) * max(1.0, kr.float().abs().max().item()),
        )
        del kc, vc, kr, vr, cache


def run_attention(rep, cfg, cases, dev, g):
    from dflash_trt.kernels import block_draft_attention
    from dflash_trt.kernels.reference import block_draft_attention_ref
    from dflash_trt.modeling.cache import KVCache

    H, HKV, D, B, dt = cfg["H"], cfg["HKV"], cfg["D"], cfg["B"], cfg["dtype"]
    for R, ctx in cases:
        S = ctx + 2 * B
        q = torch.randn(R, H, B, D, generator=g, device=dev).to(dt)
        kb, vb = (torch.randn(R, HKV, B, D, generator=g, device=dev).to(dt) for _ in range(2))
        cache = KVCache(1, R, HKV, D, S, dt, dev)
        cache.k[0].normal_(generator=g)
        cache.v[0].normal_(generator=g)
        cache.lengths.fill_(ctx)
        ctx_len = cache.lengths.to(torch.int32)
        pos = ctx + torch.arange(B, device=dev).expand(R, B)
        out = block_draft_attention(q, kb, vb, cache.k[0], cache.v[0], ctx_len)
        ref = block_draft_attention_ref(q, kb, vb, cache.k[0], cache.v[0], ctx_len)
        err = max_err(out, ref)
        t_tri = bench(lambda: block_draft_attention(q, kb, vb, cache.k[0], cache.v[0], ctx_len), dev)
        t_torch = bench(lambda: torch_attention(q, kb, vb, cache, pos), dev)
        moved = 2 * nbytes(q) + nbytes(kb, vb) + 2 * R * HKV * ctx * D * q.element_size()
        rep.add(
            "block_draft_attention",
            f"R={R} ctx={ctx} B={B} H={H} Hkv={HKV} D={D}",
            t_tri,
            t_torch,
            moved,
            err,
            err <= tol(dt),
        )
        del cache, out, ref


def run_accept(rep, cfg, greedy_rows, rejection_rows, dev, g):
    from dflash_trt.decoding import verify
    from dflash_trt.kernels import greedy_accept, rejection_accept

    B, V = cfg["B"], cfg["V"]
    for R in greedy_rows:
        logits = torch.randn(R, B, V, generator=g, device=dev)  # the target's logits are float32
        am = logits.argmax(-1)
        draft = torch.cat([am[:, :1], am[:, :-1]], 1)  # all drafts match ...
        draft[R // 2 :, B // 2] = (draft[R // 2 :, B // 2] + 1) % V  # ... except half the rows, mid-block
        got = greedy_accept(draft, logits)
        ref = verify.greedy_accept(draft, logits.argmax(-1))
        ok = torch.equal(got.accepted, ref.accepted) and torch.equal(got.bonus, ref.bonus)
        t_tri = bench(lambda: greedy_accept(draft, logits), dev)
        t_torch = bench(lambda: verify.greedy_accept(draft, logits.argmax(-1)), dev)
        rep.add(
            "greedy_accept (logits)",
            f"R={R} B={B} V={V} fp32",
            t_tri,
            t_torch,
            nbytes(logits, draft),
            0.0 if ok else 1.0,
            ok,
            "exact; err",
        )
    for R in rejection_rows:
        p = torch.softmax(torch.randn(R, B, V, generator=g, device=dev) * 3, -1)
        q = torch.softmax(torch.randn(R, B - 1, V, generator=g, device=dev) * 3, -1)
        draft = torch.randint(0, V, (R, B), generator=g, device=dev)
        draft[:, 1:] = q.argmax(-1)
        ua, us = torch.rand(R, B - 1, generator=g, device=dev) * 0.05, torch.rand(R, generator=g, device=dev)
        args = (draft, p, q, ua, us)
        got, ref = rejection_accept(*args), verify.rejection_accept(*args)
        ok = torch.equal(got.accepted, ref.accepted) and valid_bonus(p, q, got.accepted, us, got.bonus)
        n_diff = int((got.bonus != ref.bonus).sum())  # fp32 CDF rounding at a token boundary: both valid
        t_tri = bench(lambda: rejection_accept(*args), dev)
        t_torch = bench(lambda: verify.rejection_accept(*args), dev)
        moved = nbytes(draft, ua, us) + 2 * R * V * p.element_size()  # p and q rows at the accepted slot
        rep.add(
            "rejection_accept",
            f"R={R} B={B} V={V} fp32",
            t_tri,
            t_torch,
            moved,
            n_diff,
            ok,
            "rows with another valid bonus:",
        )


def valid_bonus(p, q, accepted, u, bonus, rel=1e-4) -> bool:
    """Every bonus is an inverse-CDF sample of its row's residual at u, up to fp32 rounding (float64 CDF).
    At V=152k a CDF step (~1/V) is close to fp32 rounding of the running sum, so two exact
    implementations that sum in different orders may pick neighbouring tokens; the check column
    of rejection_accept shows how many rows picked a different (valid) token than decoding/verify.py."""
    rows = torch.arange(p.shape[0], device=p.device)
    p_at = p[rows, accepted].double()
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted].double()
    res = (p_at - q_pad).clamp(min=0)
    mass = res.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, res / mass.clamp_min(1e-300), p_at)
    cdf = dist.cumsum(-1)
    target = u.double() * cdf[:, -1]
    b = bonus.long()
    below = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    at = cdf.gather(1, b[:, None])[:, 0]
    return bool(((below <= target * (1 + rel) + 1e-9) & (at >= target * (1 - rel) - 1e-9)).all())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--json", default=None, help="write results here (default: $OUT/gpu_check.json if $OUT)")
    ap.add_argument("--peak-tbs", type=float, default=None, help="peak memory bandwidth in TB/s (default by GPU)")
    ap.add_argument(
        "--only", default="inject,attention,greedy,rejection,step,engine,loop", help="comma-separated sections"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top ops for each drafter step case (both paths)",
    )
    args = ap.parse_args()
    sections = set(args.only.split(","))

    from dflash_trt.kernels import kernels_available

    if not kernels_available():
        print("error: Triton kernels cannot run here (need triton and a CUDA GPU; or --dry-run)", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cpu" if args.dry_run else "cuda")
    name = "cpu (Triton interpreter, DRY RUN)" if args.dry_run else torch.cuda.get_device_name(0)
    peak = args.peak_tbs or next((v for k, v in sorted(PEAK_TBS.items(), key=lambda kv: -len(kv[0])) if k in name), 4.8)
    cfg, cases = (TINY, TINY_CASES) if args.dry_run else (REAL, REAL_CASES)
    print(
        f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {triton.__version__}; "
        f"bandwidth bound at {peak} TB/s",
        flush=True,
    )
    if args.dry_run:
        print("DRY RUN: CPU interpreter on tiny shapes; these times are NOT GPU numbers", flush=True)
    rep = Report(dev, peak)
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        if "inject" in sections:
            run_inject(rep, cfg, cases["inject"], dev, g)
        if "attention" in sections:
            run_attention(rep, cfg, cases["attention"], dev, g)
        if sections & {"greedy", "rejection"}:
            run_accept(
                rep,
                cfg,
                cases["greedy"] if "greedy" in sections else [],
                cases["rejection"] if "rejection" in sections else [],
                dev,
                g,
            )
        if "step" in sections:
            from gpu_step_check import run_drafter_step  # scripts/, beside this file

            run_drafter_step(rep, cfg, cases["step"], dev, g, profile=args.profile)
        from gpu_engine_check import engine_parity, loop_timing  # scripts/, beside this file

        engine = engine_parity(dev) if "engine" in sections else {"skipped": "not selected"}
        loop = loop_timing(dev) if "loop" in sections and dev.type == "cuda" else []
    title = (
        f"DFlash kernels on {name}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
        f"triton {triton.__version__}; BW bound at {peak} TB/s"
    )
    print(f"\n{title}\n{rep.table()}")
    print(f"engine parity (generate kernels=triton vs torch vs baseline, greedy): {engine}")
    if loop:
        print_loop_table(loop)
    print(f"total {time.perf_counter() - t0:.0f}s")
    result = {
        "title": title,
        "device": name,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "peak_tbs": peak,
        "shapes": {k: str(v) for k, v in cfg.items()},
        "rows": rep.rows,
        "engine_parity": engine,
        "loop": loop,
        "table_markdown": rep.table(),
    }
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    bad = [r for r in rep.rows if not r["ok"]]
    engine_bad = engine.get("identical_tokens") is False
    if bad or engine_bad:
        print(f"FAILED: {len(bad)} kernel mismatches{', engine tokens differ' if engine_bad else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
