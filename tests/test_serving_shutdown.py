"""Clean shutdown (issue #30): on SIGTERM, requests in flight finish or get one clear error within the grace
period, tritonserver exits 0 without an abort, and no shared-memory region of the run is left in /dev/shm.

The orchestrator's drain is tested in-process; `dflash-trt serve` (serving/server.py serve()) is driven
over the real tritonserver (nvidia-pytriton's bundled 2.51, CPU) with a tiny random pair whose target
allows long outputs, so requests are still running when SIGTERM arrives."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import processes_mentioning, tiny_drafter, tiny_pair_dir, tiny_target

from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.serving.client import DFlashClient
from dflash_trt.serving.drain import DRAIN_ENV, drain_signal_from_env, write_drain_file
from dflash_trt.serving.jobs import GRACE_EXPIRED, SHUTTING_DOWN
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import Sampling, TokenRequest
from dflash_trt.serving.server import ServerError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


class _Sink:
    def __init__(self):
        self.msgs, self.errors = [], []
        self.done = threading.Event()
        self.ended_at: float | None = None

    def is_cancelled(self):
        return False

    def send(self, progress, final):
        self.msgs.append(progress)
        if final:
            self._end()

    def error(self, message):
        self.errors.append(message)
        self._end()

    def close(self):
        self._end()

    def _end(self):
        self.ended_at = time.monotonic()
        self.done.set()


class _SlowEngine(SpecEngine):
    """A step takes at least 20 ms, so a long request outlives the grace period on any host."""

    def step(self):
        time.sleep(0.02)
        return super().step()


@pytest.fixture(scope="module")
def pair():
    t = tiny_target("qwen3")
    return t, tiny_drafter(t, block_size=4)


def _orchestrator(pair, drain_signal=None, max_batch=4):
    t, d = pair
    return Orchestrator(
        lambda: _SlowEngine(t, d, max_batch=max_batch, max_seq_len=512), drain_signal=drain_signal, cancel_poll=0.05
    ).start()


def test_drain_finishes_short_requests_and_ends_the_rest_with_one_error_at_the_deadline(pair):
    orch = _orchestrator(pair, max_batch=3)
    try:
        short, longs, queued = _Sink(), [_Sink() for _ in range(2)], _Sink()
        orch.submit(TokenRequest([5, 17, 42], Sampling(max_tokens=6, stream=True)), short)
        for i, s in enumerate(longs):
            orch.submit(TokenRequest([9, 8, 7], Sampling(max_tokens=400, stream=i == 0, end_id=-1)), s)
        orch.submit(TokenRequest([1, 2], Sampling(max_tokens=400, end_id=-1)), queued)  # waits: 3 rows busy
        while not longs[0].msgs:
            time.sleep(0.01)
        grace, t0 = 1.0, time.monotonic()
        orch.drain(grace)
        late = _Sink()
        orch.submit(TokenRequest([3, 4], Sampling(max_tokens=4)), late)
        assert late.errors == [SHUTTING_DOWN]  # refused at once
        for s in (short, queued, *longs):
            assert s.done.wait(30)
        assert not short.errors and short.msgs[-1].finish_reason == "length" and len(short.msgs[-1].output_ids) == 6
        for s in (queued, *longs):
            assert len(s.errors) == 1 and s.errors[0].startswith(SHUTTING_DOWN) and "grace period" in s.errors[0]
            assert grace <= s.ended_at - t0 < grace + 2.0
        assert not any(p.finish_reason for p in longs[0].msgs)  # streamed chunks, then the error, no final
        deadline = time.monotonic() + 5
        while (orch.num_running or orch.engine.has_unfinished()) and time.monotonic() < deadline:  # rows freed
            time.sleep(0.01)
        assert orch.num_running == 0 and orch.num_waiting == 0 and not orch.engine.has_unfinished()
    finally:
        orch.stop()


def test_drain_file_reaches_the_orchestrator_and_a_second_write_only_shortens_the_grace(pair, tmp_path, monkeypatch):
    path = tmp_path / "drain"
    monkeypatch.setenv(DRAIN_ENV, str(path))
    poll = drain_signal_from_env()
    assert poll() is None
    orch = _orchestrator(pair, drain_signal=poll)
    try:
        s = _Sink()
        orch.submit(TokenRequest([9, 8, 7], Sampling(max_tokens=400, stream=True, end_id=-1)), s)
        while not s.msgs:
            time.sleep(0.01)
        write_drain_file(path, 60)
        deadline = time.monotonic() + 5
        while not orch.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orch.draining and not s.done.is_set()
        t0 = time.monotonic()
        write_drain_file(path, 0)  # `serve` on a second SIGTERM / Ctrl-C: end them now
        assert s.done.wait(10) and s.ended_at - t0 < 2.0 and s.errors[0].startswith(SHUTTING_DOWN)
        write_drain_file(path, 60)  # a later, longer grace cannot reopen anything
        other = _Sink()
        orch.submit(TokenRequest([1, 2], Sampling(max_tokens=4)), other)
        assert other.errors == [SHUTTING_DOWN]
    finally:
        orch.stop()
    monkeypatch.delenv(DRAIN_ENV)
    assert drain_signal_from_env() is None
    path.write_text("soon\n")  # not a number: drain at once rather than run on
    monkeypatch.setenv(DRAIN_ENV, str(path))
    assert drain_signal_from_env()() == 0.0


def test_bad_grace_period_is_one_line_naming_the_field(tmp_path):
    from dflash_trt.serving.server import TritonServer

    with pytest.raises(ServerError, match=r"^grace_period=-1: must be 0 or more seconds"):
        TritonServer(tmp_path, grace_period=-1)


def test_serve_cli_refuses_a_negative_grace_period_naming_the_option(tmp_path):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    r = CliRunner().invoke(main, ["serve", "--model-repo", str(tmp_path), "--grace-period", "-1"])
    assert r.exit_code == 2 and "--grace-period" in r.output and "-1" in r.output


# ---- the real server -------------------------------------------------------------------------
def _serving_modules():
    pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")


def _shm_prefix_of_server(repo: Path) -> str:
    """The shared-memory prefix the running tritonserver of `repo` was given (from its command line)."""
    for pid in processes_mentioning(f"--model-repository={repo}"):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            m = re.search(rb"shm-region-prefix-name=([^\0]+)", f.read())
        if m:
            return m.group(1).decode()
    raise AssertionError(f"no tritonserver for {repo} with a shared-memory prefix")


def _regions(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def _start_serve(repo: Path, grace: float, env: dict) -> tuple[subprocess.Popen, str, str]:
    from dflash_trt.serving.server import free_port

    ports = free_port(), free_port(), free_port()
    code = (
        "import sys; from dflash_trt.serving.serve_loop import serve; "
        f"sys.exit(serve({str(repo)!r}, *{ports!r}, startup_timeout=300, grace_period={grace}))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    line = proc.stdout.readline()
    assert line.startswith("ready:"), line + proc.stdout.read()[-3000:]
    log = re.search(r"\(log (\S+)\)", line).group(1)
    return proc, f"127.0.0.1:{ports[0]}", log


@pytest.fixture(scope="module")
def long_repo(tmp_path_factory):
    """The tiny pair with a target allowing 8192 positions (random RoPE weights serve any length), so a
    request of thousands of tokens is still running seconds after it starts."""
    _serving_modules()
    from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo

    root = tmp_path_factory.mktemp("shutdown")
    tiny_pair_dir(root, block_size=4)
    cfg_path = root / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 8192
    cfg_path.write_text(json.dumps(cfg))
    values = default_values(
        root / "target",
        root / "drafter",
        dtype="float32",
        max_seq_len=8192,
        max_batch=16,
        unary_instance_count=1,
        cpu_threads=1,
        apply_chat_template=False,
    )
    return fill_model_repo(default_template_dir(), root / "repo", values)


@pytest.mark.slow
def test_sigterm_with_ten_long_requests_in_flight_ends_each_cleanly_within_the_grace(long_repo):
    from dflash_trt.serving.client import DFlashClient, ServingError

    grace = 3.0
    env = dict(os.environ, DFLASH_KEEP_TRITON_LOGS="1")  # the log is read below, then removed
    proc, url, log = _start_serve(long_repo, grace, env)
    results: dict[str, tuple] = {}
    started = queue.Queue()

    def run(name: str, kind: str, max_tokens: int):
        c = DFlashClient(url)
        try:
            if kind in ("stream", "ensemble"):
                text, model = [], "ensemble" if kind == "ensemble" else None
                for chunk in c.stream("hello world", max_tokens=max_tokens, end_id=-1, model=model):
                    if not text:
                        started.put(name)
                    text.append(chunk["text"])
                    last = chunk
                results[name] = ("ok", last["finish_reason"], last["num_output_tokens"], time.monotonic())
            else:
                started.put(name)
                r = c.generate("hello world", max_tokens=max_tokens, end_id=-1)
                results[name] = ("ok", r["finish_reason"], r["num_output_tokens"], time.monotonic())
        except ServingError as e:
            results[name] = ("error", str(e), None, time.monotonic())
        finally:
            c.close()

    try:
        prefix = _shm_prefix_of_server(long_repo)
        assert _regions(prefix), "the run's Python-backend regions carry its prefix"
        jobs = {f"stream{i}": ("stream", 6000) for i in range(4)} | {f"unary{i}": ("unary", 6000) for i in range(4)}
        jobs |= {f"ensemble{i}": ("ensemble", 6000) for i in range(2)}
        threads = [threading.Thread(target=run, args=(n, k, m)) for n, (k, m) in jobs.items()]
        for t in threads:
            t.start()
        for _ in jobs:
            started.get(timeout=120)  # every stream has its first chunk; every unary call is sent
        time.sleep(1.0)  # the unary ones are admitted too
        short = threading.Thread(target=run, args=("short", "stream", 8))
        short.start()
        assert started.get(timeout=60) == "short"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in [*threads, short]:
            t.join(grace + 60)
        rc = proc.wait(120)
        out = proc.stdout.read()
        log_text = Path(log).read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert results["short"][:3] == ("ok", "length", 8), results["short"]
    for name in jobs:
        status, detail, _, ended = results[name]
        door = "in ensemble 'ensemble', " if name.startswith("ensemble") else ""  # Triton's, for an ensemble
        assert (status, detail) == ("error", door + GRACE_EXPIRED), (name, results[name])
        assert ended - t0 < grace + 5.0, (name, ended - t0)  # the grace, plus a step and the relay
    assert rc == 0, out[-3000:]
    for abort in ("Exit timeout expired", "Signal (6)", "Signal (11)", "malloc", "failed to stop server"):
        assert abort not in log_text, log_text[-3000:]
    assert "stopping: requests in flight have 3 s to finish" in out
    assert not _regions(prefix), "shared memory of the run left in /dev/shm"
    assert not processes_mentioning(str(long_repo)), "tritonserver or a backend stub left running"
    shutil.rmtree(Path(log).parent)  # the kept log folder


@pytest.mark.slow
def test_stop_after_a_killed_server_removes_only_its_own_shared_memory(tmp_path):
    """A server that died hard leaves its stubs' regions: stop() removes those of its run, no others."""
    _serving_modules()
    from test_serving import ECHO_CONFIG, ECHO_MODEL

    from dflash_trt.serving.server import TritonServer

    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    other = Path("/dev/shm") / f"triton_python_backend_shm_region_not-ours-{os.getpid()}"
    other.write_bytes(b"\0" * 16)
    try:
        srv = TritonServer(tmp_path / "repo", startup_timeout=120).start()
        ours = _regions(srv.shm_prefix)
        assert ours
        os.killpg(srv.proc.pid, signal.SIGKILL)  # server and stubs die without cleaning up
        srv.proc.wait(30)
        assert _regions(srv.shm_prefix) == ours  # left behind, as in the issue
        srv.stop()
        assert not _regions(srv.shm_prefix) and other.exists()
        assert srv.returncode == -signal.SIGKILL and srv.stop_log_tail  # not a clean exit: its log is kept
    finally:
        other.unlink(missing_ok=True)


def test_unload_watch_calls_a_standing_live_model_count_stuck_only_with_nothing_in_flight():
    from dflash_trt.serving.triton_log import UnloadWatch, loaded_models, unloaded_models

    head = "I1 model_lifecycle.cc:838] \"successfully loaded 'dflash'\"\nI1 x] \"successfully loaded 'dflash_bls'\"\n"
    log = 'I1 server.cc:321] "Timeout 40: Found 1 model versions that have in-flight inferences"\n'
    watch = UnloadWatch(stuck_after=5.0)
    assert not watch.update(log, 0.0) and not watch.update(log, 60.0)  # in flight: never stuck
    live = '"Timeout {}: Found {} live models and 0 in-flight non-inference requests"\n'
    log += '"All models are stopped, unloading models"\n' + live.format(40, 2)
    assert not watch.update(log, 61.0) and not watch.update(log, 65.0)  # still progressing within 5 s
    log += "\"successfully unloaded 'dflash' version 1\"\n" + live.format(38, 1)
    assert not watch.update(log, 65.5) and not watch.update(log, 70.0)  # the count moved at 65.5
    assert watch.update(log, 70.6)
    assert loaded_models(head) - unloaded_models(log) == {"dflash_bls"}
    busy = log + '"Timeout 30: Found 1 live models and 1 in-flight non-inference requests"\n'
    assert not UnloadWatch(0.0).update(busy, 100.0)  # a non-inference request (a repository call) in flight
    done = log + '"Timeout 37: Found 0 live models and 0 in-flight non-inference requests"\n'
    assert not UnloadWatch(0.0).update(done, 100.0)


@pytest.mark.slow
def test_sigterm_after_a_refused_then_cancelled_grpc_stream_exits_0_promptly(tmp_path):
    """Issue #41: one gRPC stream request Triton refuses (batch sizes differ across inputs), then
    stop_stream(cancel_requests=True). Triton 2.51's gRPC frontend keeps the refused request, and with
    it dflash_bls, until after its whole exit timeout (before: 43-55 s and exit 1); serve ends it once the
    unload has stood still with nothing in flight, names the model, and exits 0."""
    _serving_modules()
    import numpy as np
    import tritonclient.grpc as grpcclient

    from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo

    tiny_pair_dir(tmp_path, block_size=4)
    values = default_values(tmp_path / "target", tmp_path / "drafter", dtype="float32", max_seq_len=256, cpu_threads=1)
    repo = fill_model_repo(default_template_dir(), tmp_path / "repo", {**values, "unary_instance_count": 1})
    for unused in ("ensemble", "preprocessing", "postprocessing", "dflash_unary"):
        shutil.rmtree(repo / unused)
    proc, url, _ = _start_serve(repo, 2.0, dict(os.environ))
    try:
        answered: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: answered.put(error))
        text = grpcclient.InferInput("text_input", [2, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hi"], [b"ho"]], dtype=object))
        max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        max_tokens.set_data_from_numpy(np.array([[4]], np.int32))
        client.async_stream_infer("dflash_bls", [text, max_tokens], request_id="refused")
        with DFlashClient(url) as c:  # the stream's request has reached Triton (and been refused) by now
            assert c.stream_text("hello", max_tokens=2, model="dflash_bls")["num_output_tokens"] == 2
        client.stop_stream(cancel_requests=True)
        client.close()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM to exit: {took:.1f} s, exit {proc.returncode}")
    assert proc.returncode == 0 and took < 25, (proc.returncode, took, out[-3000:])
    assert "could not unload dflash_bls with nothing in flight" in out, out[-3000:]
    assert not processes_mentioning(str(repo)), "backend stubs left running"
