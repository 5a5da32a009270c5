#!/usr/bin/env python3
"""Serving load as the field measures it: NVIDIA AIPerf against the OpenAI endpoint, and the Triton
gRPC front door, for each proposer on ONE server build (`dflash-trt serve --proposer`), at several
concurrencies, with a fixed synthetic prompt set and a real one. Writes results.json, table.md and
plots (throughput / TTFT / ITL against concurrency) into --out.

    python scripts/aiperf_sweep.py --model-repo out/model_repo --out docs/bench_runs/DATE-aiperf-smollm2

AIPerf (`pip install aiperf`, in its own venv: --aiperf names its binary) speaks HTTP only (its
transport choices are `http`), so it drives the OpenAI API (`/v1/chat/completions`, streamed). Triton
gRPC has no field tool installable here: genai-perf drives gRPC through perf_analyzer, a C++ binary
from the Triton SDK container (the `perf-analyzer` name on PyPI resolves to a 0.1.0 placeholder), so the
gRPC rows come from scripts/load.py (`--stream` on dflash_bls, same prompts, same ITL definition:
(latency - TTFT) / (tokens - 1)), labelled `grpc (load.py)`. load.py also asks for the engine's own
per-request timings (perf_metrics): the profile behind where the curves bend.

Synthetic: AIPerf's generator at --isl tokens (stddev 0, seeded), exactly --osl output tokens
(ignore_eos). Real: the bundled `varied` prompts (dflash_trt/bench/datasets.py), up to --osl tokens.
The gRPC rows reuse the prompts AIPerf sent (its inputs.json), so both doors see the same text.
An AIPerf cell sends for --duration seconds then waits for its requests in flight; a gRPC cell sends
max(--min-requests, concurrency) requests. The server of each
proposer starts once and is stopped with SIGINT and a deadline. Other processes' CPU share over each
proposer's run is recorded (dflash_trt/contention.py): a shared machine slows every row.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_trt.contention import CpuWatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROPOSERS = ("none", "dflash", "ngram", "hybrid")
COLUMNS = [  # (key, header, format)
    ("proposer", "proposer", "{}"),
    ("dataset", "prompts", "{}"),
    ("endpoint", "endpoint", "{}"),
    ("concurrency", "conc.", "{}"),
    ("requests", "req.", "{}"),
    ("output_tok_s", "output tok/s", "{:.1f}"),
    ("request_per_s", "req/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.0f}"),
    ("speedup", "tok/s vs none", "{:.2f}x"),
]


# ---- parsing (unit-tested: tests/test_aiperf_sweep.py) ----------------------------------------------
def parse_aiperf(path: str | Path) -> dict:
    """AIPerf's profile_export_aiperf.json -> one row's metrics (ms, tok/s, req/s; errors counted)."""
    d = json.loads(Path(path).read_text())

    def stat(name: str, key: str):
        m = d.get(name)
        return None if not isinstance(m, dict) else m.get(key)

    errors = d.get("error_summary") or []
    return {
        "requests": int(stat("request_count", "avg") or 0),
        "errors": sum(int(e.get("count", 1)) for e in errors),
        "output_tok_s": stat("output_token_throughput", "avg"),
        "request_per_s": stat("request_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "latency_p50_ms": stat("request_latency", "p50"),
        "osl_mean": stat("output_sequence_length", "avg"),
    }


def parse_load(report: dict) -> dict:
    """scripts/load.py --json report -> the same row keys as parse_aiperf (seconds become ms)."""

    def ms(key: str):
        v = report.get(key)
        return None if v is None or v != v else 1e3 * v  # NaN (no samples) -> None

    row = {
        "requests": report["ok"],
        "errors": report["failed"] + report.get("not_sent", 0),
        "output_tok_s": report["output_tokens_per_s"],
        "request_per_s": report["requests_per_s"],
        "ttft_p50_ms": ms("ttft_p50_s"),
        "ttft_p99_ms": ms("ttft_p99_s"),
        "itl_p50_ms": ms("itl_p50_s"),
        "latency_p50_ms": ms("latency_p50_s"),
        "osl_mean": report["output_tokens"] / report["ok"] if report["ok"] else None,
        "tau": report.get("mean_acceptance_length"),  # tokens per verify pass (AIPerf cannot see it)
    }
    row.update({k: v for k, v in report.items() if k.startswith("engine_")})
    return row


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup: output tok/s over proposer none's in the same (dataset, endpoint, concurrency) cell."""
    base = {(r["dataset"], r["endpoint"], r["concurrency"]): r["output_tok_s"] for r in rows if r["proposer"] == "none"}
    for r in rows:
        b = base.get((r["dataset"], r["endpoint"], r["concurrency"]))
        r["speedup"] = r["output_tok_s"] / b if b and r.get("output_tok_s") is not None else None
    return rows


def markdown_table(rows: list[dict]) -> str:
    order = {p: i for i, p in enumerate(PROPOSERS)}
    rows = sorted(rows, key=lambda r: (r["dataset"], r["endpoint"], r["concurrency"], order.get(r["proposer"], 99)))
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [("-" if r.get(k) is None else f.format(r[k])) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> list[Path]:
    """One figure per (dataset, endpoint): output tok/s, TTFT p50 and ITL p50 against concurrency."""
    from dflash_trt.bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        print("plots skipped: matplotlib not installed (the `bench` extra)")
        return []
    made = []
    for ds, ep in sorted({(r["dataset"], r["endpoint"]) for r in rows}):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for p in PROPOSERS:
            pts = sorted(
                (r["concurrency"], r) for r in rows if (r["dataset"], r["endpoint"], r["proposer"]) == (ds, ep, p)
            )
            if not pts:
                continue
            xs = [c for c, _ in pts]
            for ax, key in zip(axes, ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")):
                ax.plot(xs, [r.get(key) or float("nan") for _, r in pts], marker="o", label=p)
        for ax, title in zip(axes, ("output tok/s", "TTFT p50 (ms)", "ITL p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"{ds} prompts, {ep}")
        made.append(_save(plt, fig, out / f"{ds}_{ep.split()[0]}.png"))
    return made


# ---- running ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dflash-trt serve --model-repo R --proposer P` on free loopback ports, OpenAI API included."""

    def __init__(self, repo: str, proposer: str, log: Path, startup_s: float = 300.0):
        self.grpc, self.http, self.metrics, self.openai = (free_port() for _ in range(4))
        cmd = [str(ROOT / ".venv/bin/dflash-trt"), "serve", "--model-repo", repo, "--proposer", proposer]
        cmd += ["--grpc-port", str(self.grpc), "--http-port", str(self.http), "--metrics-port", str(self.metrics)]
        cmd += ["--openai-port", str(self.openai), "--served-model-name", "target", "--grace-period", "0"]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"serve --proposer {proposer} did not become ready; see {log}")
            time.sleep(1.0)  # a poll with a deadline: the server says nothing when it is ready but /health

    def engine_pid(self) -> int:
        """The engine model's Python-backend stub among the server's descendants (for py-spy)."""
        kids: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(pid)
        todo, found = [self.proc.pid], []
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                if "/dflash/1/model.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(pid)
            except OSError:
                continue
        if not found:
            raise SystemExit("py-spy: the engine model's stub process was not found under the server")
        return max(found)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.openai}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def run_aiperf(args, srv: Server, adir: Path, prompts_file: Path | None, concs: list[int]) -> dict[int, Path]:
    """One AIPerf sweep over the concurrencies (AIPerf still starts its services again for each cell, ~40 s
    on this machine): each cell sends for --duration seconds, then waits for the requests in flight
    (grace). -> concurrency: its export."""
    cmd = [args.aiperf, "profile", "-m", "target", "--url", f"http://127.0.0.1:{srv.openai}", "--endpoint-type"]
    cmd += ["chat", "--streaming", "--tokenizer", args.tokenizer, "--concurrency", ",".join(map(str, concs))]
    cmd += ["--benchmark-duration", str(args.duration), "--benchmark-grace-period", str(args.cell_timeout)]
    cmd += ["--use-server-token-count", "--ui", "none", "--random-seed", "0", "--no-gpu-telemetry"]
    cmd += ["--artifact-dir", str(adir), "--extra-inputs", "temperature:0", "--osl", str(args.osl)]
    cmd += ["--output-tokens-stddev", "0", "--warmup-request-count", "1"]  # the server's first calls are slow
    if prompts_file is None:
        cmd += ["--isl", str(args.isl), "--prompt-input-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true"]
    else:
        cmd += ["--input-file", str(prompts_file), "--custom-dataset-type", "single_turn"]
    adir.parent.mkdir(parents=True, exist_ok=True)
    with open(adir.parent / f"{adir.name}.log", "wb") as log:
        timeout = len(concs) * (args.duration + args.cell_timeout) + 300
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout)
    return {c: adir / f"concurrency_{c}" / "profile_export_aiperf.json" for c in concs}


def sent_prompts(inputs_json: Path) -> list[str]:
    """The user messages AIPerf sent (its inputs.json), for the gRPC rows."""
    d = json.loads(inputs_json.read_text())
    out = []
    for session in d["data"]:
        for p in session["payloads"]:
            out.append(p["messages"][-1]["content"])
    return out


def run_grpc(args, srv: Server, cdir: Path, conc: int, prompts: list[str], fixed_osl: bool, spy=False) -> dict:
    """scripts/load.py --stream on dflash_bls; spy: py-spy the engine's stub meanwhile (pyspy.txt, raw)."""
    cdir.mkdir(parents=True, exist_ok=True)
    pfile = cdir / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
    cmd = [sys.executable, str(ROOT / "scripts/load.py"), "--url", f"127.0.0.1:{srv.grpc}", "--stream", "--json"]
    cmd += ["--requests", str(max(args.min_requests, conc)), "--concurrency", str(conc), "--max-tokens", str(args.osl)]
    cmd += ["--prompts-file", str(pfile), "--perf-metrics", "--duration", str(args.cell_timeout)]
    cmd += ["--ignore-eos"] if fixed_osl else []
    rec = None
    if spy:
        rec = [args.py_spy, "record", "-p", str(srv.engine_pid()), "-r", "25", "--nonblocking", "--idle", "-f", "raw"]
        rec = subprocess.Popen(
            rec + ["-o", str(cdir / "pyspy.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout + 30)
    finally:
        if rec is not None:
            rec.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
            rec.wait(60)
    (cdir / "load.json").write_text(res.stdout)
    return json.loads(res.stdout)


def write_results(args, out: Path, rows: list[dict], contention: dict) -> dict:
    add_speedups(rows)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPUs, shared with other jobs (see contention)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("aiperf", "py_spy")},
        "contention": contention,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(markdown_table(rows))
    return result


def sweep(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    real = out / "varied.jsonl"
    from dflash_trt.bench.datasets import load_dataset

    real.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in load_dataset("varied")))
    rows, contention = [], {}
    for proposer in args.proposers:
        with CpuWatch(children=True) as watch:  # the server, AIPerf and load.py are ours, not "others"
            srv = Server(args.model_repo, proposer, out / f"serve-{proposer}.log")
            try:
                for dataset, pfile, concs in (("synthetic", None, args.concurrency), ("varied", real, args.real_conc)):
                    exports = run_aiperf(args, srv, out / proposer / dataset / "openai", pfile, concs)
                    for conc, export in exports.items():
                        row = parse_aiperf(export)
                        rows.append({"proposer": proposer, "dataset": dataset, "endpoint": "openai (aiperf)",
                                     "concurrency": conc, **row})  # fmt: skip
                        print(f"{proposer} {dataset} openai c{conc}: {row['output_tok_s']:.1f} tok/s", flush=True)
                    prompts = sent_prompts(exports[concs[0]].parent / "inputs.json")
                    for conc in concs:
                        cdir, spy = (
                            out / proposer / dataset / f"grpc-c{conc}",
                            proposer == args.spy_proposer and not pfile,
                        )
                        rep = run_grpc(args, srv, cdir, conc, prompts, not pfile, spy)
                        row = parse_load(rep)
                        rows.append({"proposer": proposer, "dataset": dataset, "endpoint": "grpc (load.py)",
                                     "concurrency": conc, **row})  # fmt: skip
                        print(f"{proposer} {dataset} grpc c{conc}: {row['output_tok_s']:.1f} tok/s", flush=True)
            finally:
                code = srv.stop()
        contention[proposer] = {"others_cpu_share": watch.others_share, "serve_exit_code": code}
        result = write_results(args, out, rows, contention)  # after each proposer: a cut-short sweep keeps its rows
    plot(rows, out)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-repo", required=True, help="a repository from `dflash-trt build` (torch backend)")
    ap.add_argument("--out", required=True, help="folder for results.json, table.md, plots and raw exports")
    ap.add_argument("--tokenizer", required=True, help="the target's tokenizer folder (AIPerf counts with it)")
    ap.add_argument("--aiperf", default=str(ROOT / ".aiperf-venv/bin/aiperf"), help="the aiperf binary")
    ap.add_argument("--proposers", default=",".join(PROPOSERS), help="comma-separated (none = plain decoding)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated")
    ap.add_argument("--real-concurrency", default=None, help="for the real prompts (default: --concurrency)")
    ap.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens")
    ap.add_argument("--osl", type=int, default=32, help="output tokens (exact for synthetic, at most for real)")
    ap.add_argument("--duration", type=float, default=6.0, help="AIPerf: seconds each cell sends new requests")
    ap.add_argument("--min-requests", type=int, default=4, help="gRPC: requests per cell, max(this, concurrency)")
    ap.add_argument(
        "--py-spy", dest="spy_proposer", default=None, help="py-spy this proposer's synthetic gRPC cells (engine stub)"
    )
    ap.add_argument("--py-spy-bin", dest="py_spy", default=str(ROOT / ".aiperf-venv/bin/py-spy"))
    ap.add_argument("--cell-timeout", type=float, default=600.0, help="seconds one cell may take")
    args = ap.parse_args(argv)
    args.proposers = [p for p in args.proposers.split(",") if p]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.real_conc = [int(c) for c in (args.real_concurrency or "").split(",") if c] or args.concurrency
    if not Path(args.aiperf).is_file():
        ap.error(
            f"--aiperf {args.aiperf}: not found (python3 -m venv .aiperf-venv && .aiperf-venv/bin/pip install aiperf)"
        )
    print(markdown_table(sweep(args)["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
