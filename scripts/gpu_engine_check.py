"""The engine half of scripts/gpu_check.py: whole generate() runs rather than single kernels.

engine_parity: generate() with kernels torch / triton (and triton + CUDA graph on a GPU) emits
exactly the target-alone tokens on a tiny fp32 Qwen3. loop_timing (GPU only): generate() per
verify step on a random Qwen3-0.6B-shaped target, against the target alone and HF generate().
Called by gpu_check.py (sections `engine` and `loop`); not meant to be run on its own.
"""

from __future__ import annotations

import time

import torch


def _random_qwen3(dev, dtype, **shape):
    """A TargetModel over a random HF Qwen3 of this shape (seed 0, no eos token), on `dev` in `dtype`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_trt.modeling.target import TargetModel

    torch.manual_seed(0)
    hf_cfg = Qwen3Config(**shape)
    hf_cfg.eos_token_id = None
    return TargetModel(AutoModelForCausalLM.from_config(hf_cfg).to(dev, dtype).eval())


def engine_parity(dev) -> dict:
    """generate() with kernels='triton' emits exactly kernels='torch''s tokens (tiny random Qwen3)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    import dataclasses

    from dflash_trt.config import DrafterConfig, SamplingParams
    from dflash_trt.decoding.loop import generate, generate_baseline
    from dflash_trt.modeling.drafter import DFlashDrafter

    target = _random_qwen3(
        dev,
        torch.float32,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=256,
        max_position_embeddings=512,
    )
    cfg = DrafterConfig.for_target(target.config, num_layers=2, block_size=8)
    cfg = dataclasses.replace(cfg, head_dim=64)  # the kernels need a power of two >= 32
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).float().bind(target).eval()
    prompts = [[5, 17, 33, 2, 9], [100], [8, 8, 200, 31, 4, 66, 1]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    res = {m: generate(target, drafter, prompts, params, kernels=m, cuda_graph="off") for m in ("torch", "triton")}
    if dev.type == "cuda":
        res["triton+graph"] = generate(target, drafter, prompts, params, kernels="triton", cuda_graph="on")
    base = generate_baseline(target, prompts, params)
    same = all(r.tokens == base.tokens for r in res.values())
    return {
        "identical_tokens": same,
        "rows": len(prompts),
        "block_size": 8,
        "paths": list(res),
        "accept_hist_equal": all(r.stats.accept_hist == res["torch"].stats.accept_hist for r in res.values()),
    }


def loop_timing(dev, rows=(1, 8), prompt_len=512, new_tokens=64) -> list[dict]:
    """generate() end to end on a random Qwen3-0.6B-shaped target (bf16) with a 5-layer B=16
    drafter: wall time per verify step of the eager PyTorch path, the Triton kernels, and the
    kernels replayed from a CUDA graph, tokens checked identical. Random weights accept ~nothing
    (tau ~1), so this is the loop's cost per step, not a speedup; the target forward is eager."""
    from dflash_trt.config import DrafterConfig, SamplingParams
    from dflash_trt.decoding.loop import generate, generate_baseline
    from dflash_trt.modeling.drafter import DFlashDrafter

    target = _random_qwen3(
        dev,
        torch.bfloat16,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    drafter = DFlashDrafter(DrafterConfig.for_target(target.config, num_layers=5, block_size=16)).bind(target).eval()
    modes = {
        "torch": dict(kernels="torch", cuda_graph="off"),
        "triton": dict(kernels="triton", cuda_graph="off"),
        "triton+graph": dict(kernels="triton", cuda_graph="on"),
    }
    out = []
    for R in rows:
        g = torch.Generator().manual_seed(R)
        prompts = torch.randint(0, target.vocab_size, (R, prompt_len), generator=g).tolist()
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        base = generate_baseline(target, prompts, params)
        res, per_step = {}, {}
        for name, kw in modes.items():
            generate(target, drafter, prompts, SamplingParams(max_new_tokens=20, ignore_eos=True), **kw)  # warm up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res[name] = generate(target, drafter, prompts, params, **kw)
            torch.cuda.synchronize()
            batch_steps = res[name].stats.num_verify_steps / R  # stats count steps per request
            per_step[name] = (time.perf_counter() - t0 - res[name].stats.prefill_time) / batch_steps
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate_baseline(target, prompts, params)
        torch.cuda.synchronize()
        t_base = (time.perf_counter() - t0) / new_tokens
        ids = torch.tensor(prompts, device=dev)
        hf_kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        target.hf.generate(ids, **{**hf_kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.hf.generate(ids, **hf_kw)
        torch.cuda.synchronize()
        t_hf = (time.perf_counter() - t0) / new_tokens
        # bf16: a block verify and one-token decoding may round a near-tie differently, so this is
        # reported (with where rows first differ) rather than failed; engine_parity is the exact check
        diverge = {
            k: min(
                (
                    next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                    for x, y in zip(r.tokens, base.tokens)
                ),
                key=lambda i: 1e9 if i is None else i,
            )
            for k, r in res.items()
        }
        row = dict(
            rows=R,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            tau=res["torch"].stats.tau,
            identical=all(r.tokens == base.tokens for r in res.values()),
            first_divergence=diverge,
            ms_per_step={k: round(v * 1e3, 2) for k, v in per_step.items()},
            baseline_ms_per_token=round(t_base * 1e3, 2),
            hf_generate_ms_per_token=round(t_hf * 1e3, 2),
            dflash_paths_agree=all(r.tokens == res["torch"].tokens for r in res.values()),
        )
        print(
            f"  loop R={R}: ms per verify step {row['ms_per_step']}, target alone {row['baseline_ms_per_token']} "
            f"ms/token, HF generate() {row['hf_generate_ms_per_token']} ms/token, tau {row['tau']:.2f}, "
            f"identical to the target alone {row['identical']} (first divergence {diverge}), DFlash paths agree "
            f"{row['dflash_paths_agree']}",
            flush=True,
        )
        out.append(row)
    return out
