"""Evaluate a drafter by real generation: tau, per-position acceptance, speedup over the baseline.

Boundary: runs DFlash and the autoregressive baseline on the same held-out prompts, one prompt at
a time, interleaved (A B A B) so both see the same machine state; greedy outputs must agree.
"""

from __future__ import annotations

from dflash_trt.config import SamplingParams
from dflash_trt.errors import DFlashError


def evaluate(target: str, drafter_dir: str, source: str, limit: int = 8, max_new_tokens: int = 128,
             chat: bool = True, dtype: str = "auto", target_model=None) -> dict:
    from dflash_trt.pipeline import encode, load_drafter, load_target, load_tokenizer, stop_ids
    from dflash_trt.spec.loop import GenerationStats, generate, generate_baseline
    from dflash_trt.train.data import load_prompts

    prompts = load_prompts(source, limit)
    if target_model is None:
        tgt, path = load_target(target, dtype)
    else:
        tgt, path = target_model
    drafter = load_drafter(tgt, drafter_dir)
    tok = load_tokenizer(path)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids(tok))
    spec, base = GenerationStats(), GenerationStats()
    mismatches = 0
    for p in prompts:
        ids = encode(tok, p, chat)
        a = generate(tgt, drafter, [ids], params)
        b = generate_baseline(tgt, [ids], params)
        mismatches += a.tokens != b.tokens
        spec.merge(a.stats)
        base.merge(b.stats)
    if mismatches:
        raise DFlashError(f"{mismatches} prompt(s) gave different greedy output with DFlash: this is a bug, "
                          f"please report it with the prompt")
    return {"num_prompts": len(prompts), "tau": spec.tau, "acceptance_rate": spec.acceptance_rate,
            "per_position_acceptance": spec.per_position_acceptance, "accept_hist": spec.accept_hist,
            "dflash_tokens_per_s": spec.decode_tokens_per_s, "baseline_tokens_per_s": base.decode_tokens_per_s,
            "speedup": spec.decode_tokens_per_s / base.decode_tokens_per_s if base.decode_tokens_per_s else None,
            "block_size": drafter.block_size}


def print_eval(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"DFlash eval on {res['num_prompts']} held-out prompts (block size {res['block_size']})")
    for col in ("tau", "acceptance", "DFlash tok/s", "baseline tok/s", "speedup"):
        t.add_column(col, justify="right")
    sp = f"{res['speedup']:.2f}x" if res["speedup"] else "n/a"
    t.add_row(f"{res['tau']:.2f}", f"{res['acceptance_rate']:.2f}", f"{res['dflash_tokens_per_s']:.1f}",
              f"{res['baseline_tokens_per_s']:.1f}", sp)
    Console().print(t)
    Console().print("per-position acceptance: " + " ".join(f"{p:.2f}" for p in res["per_position_acceptance"]))
