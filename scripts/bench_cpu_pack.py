"""What packing the CPU weights (modeling/cpu_pack.py) is worth: the same target loaded twice, plain
nn.Linear and oneDNN-packed (with its drafter packed too, as load_drafter does next to a packed
target), each running plain decoding and DFlash on the same prompts,
interleaved per prompt in one process (A B A B), greedy, fp32. Prints a table; --json writes it.

    python scripts/bench_cpu_pack.py --target qwen2.5-coder-0.5b-instruct --drafter DIR \\
        --dataset humaneval -n 4 --max-new-tokens 96 --block-size 16,8 --json out.json

Every output must equal the dense baseline's (fp32); a difference is counted and printed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform

import torch

from dflash_trt.api import encode, load_drafter, load_target, load_tokenizer, set_block_size, stop_ids
from dflash_trt.config import SamplingParams
from dflash_trt.contention import CpuWatch
from dflash_trt.decoding.loop import generate, generate_baseline
from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.modeling.cpu_pack import pack_target, pack_unavailable_reason
from dflash_trt.train.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="DFlash checkpoint folder (or bundled name)")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("-n", type=int, default=4, help="prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", default="", help="comma-separated; default: the drafter's own")
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if why := pack_unavailable_reason("cpu", torch.float32):
        raise SystemExit(f"packing is unavailable here: {why}")

    dense, path = load_target(a.target, "float32", device="cpu", packed=False)
    packed = copy.deepcopy(dense)
    pack_target(packed)
    targets = {"dense": dense, "packed": packed}
    drafters = {k: load_drafter(t, a.drafter) for k, t in targets.items()}
    sizes = [int(b) for b in a.block_size.split(",") if b] or [drafters["dense"].block_size]
    tok = load_tokenizer(path)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop_token_ids=stop_ids(tok))
    prompts = [encode(tok, p, not a.no_chat) for p in load_prompts(a.dataset, a.n)]
    runs = [(k, "baseline", None) for k in targets] + [(k, "dflash", b) for k in targets for b in sizes]
    stats = {r: DecodeStats() for r in runs}
    short = dataclasses.replace(params, max_new_tokens=8)
    for k, m, b in runs:  # warm-up, discarded
        _run(targets[k], drafters[k], m, b, prompts[0][:48], short)
    mismatches = 0
    with CpuWatch() as watch:
        for ids in prompts:
            ref = None
            for r in runs:
                out = _run(targets[r[0]], drafters[r[0]], r[1], r[2], ids, params)
                ref = ref or out.tokens
                mismatches += out.tokens != ref
                stats[r].merge(out.stats)
    base = stats[("dense", "baseline", None)].decode_tokens_per_s
    rows = [
        {
            "weights": k,
            "method": m,
            "block_size": b,
            "tokens_per_s": st.decode_tokens_per_s,
            "speedup_vs_dense_baseline": st.decode_tokens_per_s / base if base else None,
            "tau": st.tau,  # 1.0 for the baseline (decoding/stats.py)
            "verify_ms_per_step": 1e3 * st.verify_time / max(st.num_verify_steps, 1),
            "draft_ms_per_step": 1e3 * st.draft_time / max(st.num_verify_steps, 1),
        }
        for (k, m, b), st in stats.items()
    ]
    print(
        f"{a.target}, {len(prompts)} {a.dataset} prompts x {a.max_new_tokens} tokens, fp32, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print("| weights | method | tok/s | vs dense baseline | tau | draft / verify ms per step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + (f" B={r['block_size']}" if r["block_size"] else "")
        print(
            f"| {r['weights']} | {name} | {r['tokens_per_s']:.2f} | {r['speedup_vs_dense_baseline']:.2f}x | "
            f"{r['tau']:.2f} | {r['draft_ms_per_step']:.0f} / {r['verify_ms_per_step']:.0f} |"
        )
    print(
        f"outputs differing from the first run of their prompt: {mismatches}; "
        f"other processes' CPU share {watch.others_share:.1%}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "target": a.target,
                    "drafter": a.drafter,
                    "dataset": a.dataset,
                    "prompts": len(prompts),
                    "max_new_tokens": a.max_new_tokens,
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                    "mismatches": mismatches,
                    "other_cpu_share": watch.others_share,
                },
                f,
                indent=1,
            )


def _run(target, drafter, method, block, ids, params):
    if method == "baseline":
        return generate_baseline(target, [ids], params)
    set_block_size(drafter, block)
    return generate(target, drafter, [ids], params)


if __name__ == "__main__":
    main()
