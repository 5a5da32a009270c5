"""scripts/aiperf_sweep.py without a server: AIPerf's export and load.py's report parsed into the same row
keys and units, speedups against proposer none in the same cell only, the markdown table, the prompts
taken back from AIPerf's inputs.json; and load.py's ITL and engine-timing summaries."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sweep = _load("aiperf_sweep")
load = _load("load")


def _aiperf_export(tmp_path: Path, errors=()) -> Path:
    d = {
        "request_count": {"unit": "requests", "avg": 12.0},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 41.5},
        "request_throughput": {"unit": "requests/sec", "avg": 1.25},
        "time_to_first_token": {"unit": "ms", "avg": 300.0, "p50": 250.0, "p99": 900.0},
        "inter_token_latency": {"unit": "ms", "avg": 80.0, "p50": 75.0, "p99": 120.0},
        "request_latency": {"unit": "ms", "avg": 2000.0, "p50": 1900.0, "p99": 2600.0},
        "output_sequence_length": {"unit": "tokens", "avg": 24.0},
        "error_summary": list(errors),
    }
    p = tmp_path / "profile_export_aiperf.json"
    p.write_text(json.dumps(d))
    return p


def test_parse_aiperf_takes_the_p50s_averages_and_counts_errors(tmp_path):
    row = sweep.parse_aiperf(_aiperf_export(tmp_path, [{"error_details": {"code": 503}, "count": 3}]))
    assert row["requests"] == 12 and row["errors"] == 3
    assert row["output_tok_s"] == 41.5 and row["request_per_s"] == 1.25
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"], row["itl_p50_ms"]) == (250.0, 900.0, 75.0)
    assert row["latency_p50_ms"] == 1900.0 and row["osl_mean"] == 24.0


def test_parse_load_converts_seconds_to_ms_and_keeps_engine_timings():
    report = {
        "ok": 8,
        "failed": 1,
        "not_sent": 1,
        "output_tokens": 192,
        "output_tokens_per_s": 30.0,
        "requests_per_s": 0.5,
        "ttft_p50_s": 0.25,
        "ttft_p99_s": 0.5,
        "itl_p50_s": 0.08,
        "latency_p50_s": float("nan"),  # no samples: reported as missing, not as NaN ms
        "engine_verify_ms_per_step": 50.0,
        "mean_acceptance_length": 1.5,
    }
    row = sweep.parse_load(report)
    assert row["requests"] == 8 and row["errors"] == 2 and row["osl_mean"] == 24.0
    assert row["ttft_p50_ms"] == 250.0 and row["ttft_p99_ms"] == 500.0 and row["itl_p50_ms"] == pytest.approx(80.0)
    assert row["latency_p50_ms"] is None and row["engine_verify_ms_per_step"] == 50.0 and row["tau"] == 1.5


def test_speedups_compare_within_the_same_cell_only():
    rows = [
        {"proposer": "none", "dataset": "synthetic", "endpoint": "e", "concurrency": 1, "output_tok_s": 10.0},
        {"proposer": "dflash", "dataset": "synthetic", "endpoint": "e", "concurrency": 1, "output_tok_s": 15.0},
        {"proposer": "none", "dataset": "synthetic", "endpoint": "e", "concurrency": 4, "output_tok_s": 20.0},
        {"proposer": "dflash", "dataset": "synthetic", "endpoint": "e", "concurrency": 4, "output_tok_s": 10.0},
        {"proposer": "dflash", "dataset": "varied", "endpoint": "e", "concurrency": 1, "output_tok_s": 9.0},
    ]
    sweep.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 1.5, 1.0, 0.5, None]  # varied has no baseline row
    table = sweep.markdown_table(rows).splitlines()
    assert table[0].startswith("| proposer | prompts | endpoint | conc.") and len(table) == 2 + len(rows)
    assert "| dflash | synthetic | e | 4 | - |" in table[5] and table[5].endswith("| 0.50x |")
    assert table[-1].endswith("| - |")  # no baseline: no speedup printed


def test_sent_prompts_reads_aiperf_inputs(tmp_path):
    inputs = {
        "data": [
            {"session_id": "a", "payloads": [{"messages": [{"role": "user", "content": "first"}]}]},
            {"session_id": "b", "payloads": [{"messages": [{"role": "user", "content": "second"}]}]},
        ]
    }
    p = tmp_path / "inputs.json"
    p.write_text(json.dumps(inputs))
    assert sweep.sent_prompts(p) == ["first", "second"]


def test_load_itl_and_engine_times():
    assert load._itl({"latency": 2.0, "ttft": 0.5, "num_output_tokens": 16}) == pytest.approx(0.1)
    assert load._itl({"latency": 2.0, "ttft": 0.5, "num_output_tokens": 1}) is None  # one token: no gap
    assert load._itl({"latency": 2.0, "ttft": None, "num_output_tokens": 8}) is None  # unary: no first chunk
    perf = {
        "e2e_time": 4.0,
        "prefill_time": 0.2,
        "draft_time": 0.6,
        "verify_time": 1.2,
        "sources": {"drafter": {"steps": 10}, "copied": {"steps": 2}},
    }
    times = load.engine_times([{"perf_metrics": perf}, {"perf_metrics": None}])
    assert times["engine_steps_per_request"] == 12
    assert times["engine_verify_ms_per_step"] == pytest.approx(100.0)
    assert times["engine_draft_ms_per_step"] == pytest.approx(50.0)
    assert times["engine_busy_share"] == pytest.approx(0.5) and math.isclose(times["engine_prefill_ms"], 200.0)
    assert load.engine_times([{"perf_metrics": None}]) == {}


def test_profile_phases_from_py_spy_raw_stacks():
    prof = _load("aiperf_sweep_profile")
    loop = "Thread.run (threading.py:982);Orchestrator._loop (dflash_trt/serving/orchestrator.py:200);"
    raw = "\n".join(
        [
            loop + "Orchestrator._step (dflash_trt/serving/orchestrator.py:294);SpecEngine.step "
            "(dflash_trt/decoding/engine.py:211);SpecEngine.verify (dflash_trt/decoding/engine.py:340) 6",
            loop + "SpecEngine._round (dflash_trt/decoding/engine.py:219);SpecEngine.propose "
            "(dflash_trt/decoding/engine.py:260) 2",
            loop + "Orchestrator._admit (dflash_trt/serving/orchestrator.py:275);SpecEngine.add_requests "
            "(dflash_trt/decoding/engine.py:170);SpecEngine.verify (dflash_trt/decoding/engine.py:340) 1",
            loop + "Event.wait (threading.py:629);Condition.wait (threading.py:331) 1",
            "TritonPythonModel.execute (/repo/dflash/1/model.py:300) 2",  # another thread, busy
            "Thread.run (threading.py:982);TMonitor.run (tqdm/_monitor.py:69);Condition.wait (threading.py:331) 9",
            "not a sample line",
        ]
    )
    shares = prof.summarize(raw)  # 10 loop samples; the prefill's verify frame does not make it a verify
    assert shares == pytest.approx(
        {
            "verify (target forward)": 0.6,
            "draft (drafter / copy)": 0.2,
            "prefill (new rows)": 0.1,
            "idle (waiting)": 0.1,
            prof.OTHERS: 0.2,  # the idle helper thread does not count
        }
    )
    table = prof.table({"c1": shares, "c16": {}}).splitlines()
    assert table[0] == "| phase | c1 | c16 |" and "| verify (target forward) | 60% | 0% |" in table
    assert prof.summarize("") == {}
