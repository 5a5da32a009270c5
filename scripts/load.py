#!/usr/bin/env python3
"""Load generator for a running dflash Triton server (loopback only): N requests, at most C in
flight, stopped at --duration seconds; reports throughput and latency percentiles.

    python scripts/load.py --url 127.0.0.1:8001 --requests 64 --concurrency 8 --max-tokens 64 [--stream]

Non-streaming requests are unary `infer` calls on --model (default dflash_unary); --stream sends
them over gRPC streams to --stream-model (default dflash_bls) and also measures time to first
chunk and the inter-token latency ((latency - ttft) / (tokens - 1), AIPerf's definition). Prompts
cycle through --prompt (repeatable), --prompts-file (jsonl, {"text": ...} per line) or a built-in set;
--ignore-eos sends end_id -1 (fixed output lengths); --perf-metrics asks the engine for its own timings
(per request: prefill, draft and verify seconds, steps) and reports their means per step. Prints a
table, or JSON with --json. Exit code 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_trt.decoding.stats import acceptance_rate  # noqa: E402
from dflash_trt.serving.client import build_inputs, parse_result  # noqa: E402

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
PROMPTS = [
    "Explain speculative decoding in one paragraph.",
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about GPUs.",
    "List three prime numbers:",
    "Once upon a time",
]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _sampling(args) -> dict:
    return {
        "temperature": args.temperature,
        "end_id": -1 if args.ignore_eos else None,
        "return_perf_metrics": args.perf_metrics,
    }


def engine_times(results: list[dict]) -> dict:
    """Means over requests of the engine's own timings (orchestrator perf_metrics): ms per draft / verify
    pass of the batch the request rode in, prefill ms, and the share of its end-to-end time the engine
    spent computing its batch's passes (the rest: waiting for a row, other requests' prefills, the
    Python backend and the front door)."""
    perf = [r["perf_metrics"] for r in results if r.get("perf_metrics")]
    if not perf:
        return {}
    steps = [max(1, sum(s["steps"] for s in p["sources"].values())) for p in perf]
    busy = [p["prefill_time"] + p["draft_time"] + p["verify_time"] for p in perf]
    return {
        "engine_verify_ms_per_step": 1e3 * statistics.fmean(p["verify_time"] / n for p, n in zip(perf, steps)),
        "engine_draft_ms_per_step": 1e3 * statistics.fmean(p["draft_time"] / n for p, n in zip(perf, steps)),
        "engine_prefill_ms": 1e3 * statistics.fmean(p["prefill_time"] for p in perf),
        "engine_steps_per_request": statistics.fmean(steps),
        "engine_busy_share": statistics.fmean(b / p["e2e_time"] for b, p in zip(busy, perf) if p["e2e_time"] > 0),
    }


def _itl(r: dict) -> float | None:
    """Mean time between tokens after the first: (latency - ttft) / (tokens - 1), as AIPerf defines it."""
    n = r.get("num_output_tokens") or 0
    return (r["latency"] - r["ttft"]) / (n - 1) if r.get("ttft") is not None and n > 1 else None


async def one_unary(client, args, prompt: str) -> dict:
    t0 = time.perf_counter()
    res = await client.infer(args.model, build_inputs(prompt, args.max_tokens, **_sampling(args)))
    r = parse_result(res)
    r["latency"] = time.perf_counter() - t0
    return r


async def one_stream(client, args, prompt: str) -> dict:
    t0 = time.perf_counter()
    inputs = build_inputs(prompt, args.max_tokens, stream=True, **_sampling(args))

    async def requests():
        yield {
            "model_name": args.stream_model,
            "inputs": inputs,
            "request_id": uuid.uuid4().hex,
            "enable_empty_final_response": True,
        }

    first, last, text = None, {}, []
    async for result, error in client.stream_infer(inputs_iterator=requests()):
        if error is not None:
            raise RuntimeError(str(error))
        resp = result.get_response()
        if resp.outputs:
            last = parse_result(result)
            text.append(last["text"])
            first = first or time.perf_counter() - t0
        if resp.parameters["triton_final_response"].bool_param:
            break
    return {**last, "text": "".join(text), "ttft": first, "latency": time.perf_counter() - t0}


async def run(args) -> dict:
    from tritonclient.grpc.aio import InferenceServerClient

    client = InferenceServerClient(args.url)
    prompts = args.prompt or (_read_prompts(args.prompts_file) if args.prompts_file else PROMPTS)
    results, errors = [], []
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.perf_counter() + args.duration

    async def worker(i: int):
        async with sem:
            if time.perf_counter() > deadline:
                return
            try:
                fn = one_stream if args.stream else one_unary
                results.append(
                    await asyncio.wait_for(
                        fn(client, args, prompts[i % len(prompts)]), max(0.1, deadline - time.perf_counter())
                    )
                )
            except Exception as e:  # counted, not fatal: a load test reports failures
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(args.requests)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    itl = [x for x in map(_itl, results) if x is not None]
    out_tokens = sum(r.get("num_output_tokens") or 0 for r in results)
    drafted = sum(r.get("total_draft_tokens") or 0 for r in results)
    accepted = sum(r.get("total_accepted_draft_tokens") or 0 for r in results)
    report = {
        "requests": args.requests,
        "ok": len(results),
        "failed": len(errors),
        "not_sent": args.requests - len(results) - len(errors),
        "wall_s": wall,
        "requests_per_s": len(results) / wall if wall else 0.0,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "acceptance_rate": acceptance_rate(accepted, drafted),  # decoding/stats.py
        "mean_acceptance_length": statistics.fmean(
            [r["acceptance_length"] for r in results if r.get("acceptance_length")] or [0.0]
        ),
    }
    for name, xs in (("latency", lat), ("ttft", ttft), ("itl", itl)):
        for q in (0.5, 0.9, 0.99):
            report[f"{name}_p{int(q * 100)}_s"] = percentile(xs, q)
    report.update(engine_times(results))
    report["errors"] = errors[:5]
    return report


def _read_prompts(path: str) -> list[str]:
    return [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint (loopback only)")
    ap.add_argument("--model", default="dflash_unary")
    ap.add_argument("--stream-model", default="dflash_bls")
    ap.add_argument("--stream", action="store_true", help="stream responses (also measures time to first chunk)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=120.0, help="stop sending after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a built-in set")
    ap.add_argument("--prompts-file", help='jsonl, one {"text": "..."} per line (AIPerf single_turn)')
    ap.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens (end_id -1)")
    ap.add_argument("--perf-metrics", action="store_true", help="report the engine's own per-step timings")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    host = args.url.rsplit(":", 1)[0]
    if host not in LOOPBACK:
        ap.error(f"--url {args.url}: loopback addresses only ({', '.join(sorted(LOOPBACK))})")
    if args.requests < 1 or args.concurrency < 1 or args.duration <= 0:
        ap.error("--requests, --concurrency and --duration must be positive")
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
