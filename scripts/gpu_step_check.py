"""One whole DFlash drafter step at the real (Qwen3-8B drafter) shape for scripts/gpu_check.py:
inject B verified tokens, draft one block, with the Triton kernels against the PyTorch path, eager
and replayed from a CUDA graph, optionally profiled. Imported by gpu_check.py (same folder), which
owns the shapes, timing and the report table.
"""

from __future__ import annotations

import time

import torch
from gpu_check import bench, max_err, nbytes


class _StubTarget:
    """What DFlashDrafter.bind / draft_block need of a target: config, sizes, device, embedding."""

    def __init__(self, cfg, dev, dtype):
        from types import SimpleNamespace

        self.config = SimpleNamespace(hidden_size=cfg.hidden_size)
        self.vocab_size, self.num_layers, self.device, self.dtype = cfg.vocab_size, cfg.num_target_layers, dev, dtype
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=dtype)


def run_drafter_step(rep, cfg, cases, dev, g, profile=False):
    """One whole drafter step at the real shape: inject B verified tokens, draft one block."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.modeling.cuda_graph import cuda_capture
    from dflash_trt.modeling.drafter import DFlashDrafter

    d, B, dt = cfg["d"], cfg["B"], cfg["dtype"]
    dc = DrafterConfig(
        hidden_size=d,
        intermediate_size=3 * d,
        num_hidden_layers=cfg["L"],
        num_attention_heads=cfg["H"],
        num_key_value_heads=cfg["HKV"],
        head_dim=cfg["D"],
        vocab_size=cfg["V"],
        num_target_layers=36,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=0,
        block_size=B,
    )
    with torch.device(dev):
        drafter = DFlashDrafter(dc)
    drafter.bind(_StubTarget(dc, dev, dt)).eval()
    for R, ctx in cases:
        taps = torch.randn(R, B, 5 * d, generator=g, device=dev).to(dt)
        n_new = torch.full((R,), B, device=dev)
        block = torch.randint(0, dc.vocab_size, (R, B), generator=g, device=dev)
        out, times, context = {}, {}, None
        for mode in ("triton", "torch"):
            step, context = drafter_step(drafter, mode, ctx, taps, n_new, block, context, g)
            out[mode] = step()
            times[mode] = bench(step, dev)
            if profile:
                try:
                    profile_step(step, dev, f"drafter step R={R} ctx={ctx} kernels={mode}")
                except Exception as e:  # noqa: BLE001 - a diagnostic only
                    print(f"  profile failed: {type(e).__name__}: {e}")
        err = max_err(out["triton"], out["torch"])
        weights = sum(nbytes(p) for p in drafter.parameters())
        moved = (
            weights
            + nbytes(taps)
            + 2 * dc.num_hidden_layers * R * dc.num_key_value_heads * (ctx + B) * dc.head_dim * taps.element_size()
        )
        scale = out["torch"].float().abs().max().item()  # bf16: the paths round differently; flag layout-size errors
        tol_ok = (1e-3 if dt == torch.float32 else 0.1) * scale
        shape = f"R={R} ctx={ctx} inject {B} + block {B}, L={dc.num_hidden_layers}"
        rep.add("drafter step", shape, times["triton"], times["torch"], moved, err, err <= tol_ok)
        if dev.type == "cuda":  # the same step replayed from a CUDA graph: what launch overhead costs eagerly
            gtimes, gerr = {}, 0.0
            for mode in ("triton", "torch"):
                step, _ = drafter_step(drafter, mode, ctx, taps, n_new, block, context, g)
                try:
                    graph, gout = cuda_capture(step)
                except Exception as e:  # noqa: BLE001 - reported, not fatal: eager numbers stand
                    print(f"  CUDA graph capture of the {mode} path failed: {type(e).__name__}: {str(e)[:160]}")
                    gtimes[mode] = float("nan")
                    continue
                graph.replay()
                gerr = max(gerr, max_err(gout, out[mode]))
                gtimes[mode] = bench(graph.replay, dev)
                del graph, gout
            print(
                f"  CUDA graph: triton {times['triton']:.0f} -> {gtimes['triton']:.0f} us, "
                f"torch {times['torch']:.0f} -> {gtimes['torch']:.0f} us (eager -> replay)"
            )
            rep.add(
                "drafter step, CUDA graph",
                shape,
                gtimes["triton"],
                gtimes["torch"],
                moved,
                gerr,
                gerr <= tol_ok,
                err_label="max err vs eager",
            )
        drafter.use_kernels("torch")
        del step, context


def drafter_step(drafter, mode, ctx, taps, n_new, block, context, g):
    """A fresh `mode` cache whose slots hold `context` (drawn at its shape when None, so both paths
    see the same K/V) -> (step, context); step() resets the row lengths to ctx, injects the taps
    and drafts the block, so it can be timed or captured repeatedly."""
    drafter.use_kernels(mode)
    cache = drafter.new_cache(taps.shape[0], ctx + block.shape[1])
    if context is None:
        context = torch.randn(cache.k[0].shape, generator=g, device=taps.device).to(taps.dtype)
    for t in (*cache.k, *cache.v):
        t.copy_(context)

    def step():
        cache.lengths.fill_(ctx)
        drafter.inject_context(taps, n_new, cache)
        return drafter.draft_block(block, cache)

    return step, context


def profile_step(fn, dev, label, steps=5):
    """Where a step's time goes: torch.profiler's top ops by device (or CPU) time, and the step's
    wall time against the sum of its kernel times (a large gap = launch/Python bound)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e6
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels only
    busy = sum(e.device_time_total for e in kernels) / steps if dev.type == "cuda" else float("nan")
    print(f"\n-- profile: {label}: wall {wall:.0f} us/step, device busy {busy:.0f} us/step (under the profiler)")
    print(events.table(sort_by=key, row_limit=12, max_name_column_width=60))
