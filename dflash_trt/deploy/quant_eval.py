"""The `eval` build stage: how much do fp8 / nvfp4 weights change DFlash, on held-out prompts?

Boundary: measurement only. Greedy DFlash generation of the bf16 pair (the input folders) and of
the quantized pair (the `quantize` outputs, dequantised on load: deploy/simulate.py) on prompts
that were not used for calibration; reports each pair's tau (accepted tokens per verify step)
and how often the quantized pair emits the same greedy tokens as the bf16 pair.
  token_agreement   matching positions / positions of the bf16 output (position by position;
                    a shorter quantized output counts its missing positions as mismatches)
  prefix_agreement  mean fraction of the bf16 output reproduced before the first mismatch
  exact_match       fraction of prompts whose whole outputs are identical
"""

from __future__ import annotations

from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer, stop_ids
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate
from dflash_trt.deploy.files import write_json
from dflash_trt.errors import ConfigError
from dflash_trt.train.prompts import load_prompts

# Held-out prompts: written for this report, never used for calibration (calibration uses stdlib
# docstring prompts) or training. Mixed code / prose / arithmetic, short enough for CPU runs.
BUILTIN_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences why the sky is blue.",
    "List three differences between a process and a thread.",
    "Write a haiku about compilers.",
    "What is 17 * 23? Show the steps.",
    "Write a SQL query that counts orders per customer.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Write a bash one-liner that finds the ten largest files in a directory tree.",
    "Give a short definition of a hash table and its average lookup cost.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python class for a stack with push, pop and peek.",
    "Why do we use version control? Answer in three bullet points.",
    "Describe the difference between TCP and UDP.",
    "Write a regular expression that matches an ISO date like 2024-05-17.",
    "Suggest a name for a coffee shop run by robots and explain it.",
    "Write a function in JavaScript that debounces another function.",
)


def eval_prompts(source: str, n: int) -> list[str]:
    if source == "builtin":
        if n > len(BUILTIN_PROMPTS):
            raise ConfigError(
                f"eval_prompts={n}: the builtin set has {len(BUILTIN_PROMPTS)} prompts; lower it or "
                f"set eval_source: humaneval | writingbench | FILE"
            )
        return list(BUILTIN_PROMPTS[:n])
    return load_prompts(source, n)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy-token agreement of `got` against the reference outputs `ref` (see module docstring)."""
    match = total = 0
    prefix, exact = [], 0
    for r, g in zip(ref, got):
        same = [a == b for a, b in zip(r, g)]
        match += sum(same)
        total += len(r)
        first = same.index(False) if False in same else len(same)
        prefix.append(first / len(r) if r else 1.0)
        exact += int(r == g)
    n = max(len(ref), 1)
    return {
        "token_agreement": match / total if total else 1.0,
        "prefix_agreement": sum(prefix) / n,
        "exact_match": exact / n,
    }


def _run_pair(target_dir, drafter_dir, ids, params, dtype):
    target, _ = load_target(str(target_dir), dtype, progress=False)
    drafter = load_drafter(target, str(drafter_dir))
    out = generate(target, drafter, ids, params)
    return out.tokens, out.stats.tau


def evaluate_quantized(ctx) -> dict:
    cfg = ctx.cfg
    tok = load_tokenizer(ctx.dirs["tokenizer"])
    chat = bool(getattr(tok, "chat_template", None))
    prompts = eval_prompts(cfg.eval_source, cfg.eval_prompts)
    ids = [encode(tok, p, chat)[: max(8, cfg.max_seq_len - cfg.eval_max_new_tokens - 1)] for p in prompts]
    params = SamplingParams(max_new_tokens=cfg.eval_max_new_tokens, stop_token_ids=stop_ids(tok))
    ref, tau_ref = _run_pair(ctx.dirs["target"], ctx.dirs["drafter"], ids, params, cfg.dtype)
    got, tau_q = _run_pair(ctx.model_dir("target"), ctx.model_dir("drafter"), ids, params, cfg.dtype)
    res = {
        "prompts": len(ids),
        "source": cfg.eval_source,
        "max_new_tokens": cfg.eval_max_new_tokens,
        "target_quant": cfg.target_quant,
        "drafter_quant": cfg.drafter_quant,
        "dtype": cfg.dtype,
        "tau_bf16": tau_ref,
        "tau_quantized": tau_q,
        **agreement(ref, got),
        "note": "bf16 pair = the input folders at `dtype`; quantized pair = dequantised fp8/nvfp4 weights",
    }
    write_json(ctx.work / "eval" / "eval.json", res)
    ctx.echo(
        f"eval: tau bf16 {tau_ref:.2f} vs quantized {tau_q:.2f}; greedy token agreement "
        f"{res['token_agreement']:.1%}, exact match {res['exact_match']:.0%} on {len(ids)} held-out prompts"
    )
    return res
