"""End to end over a real tritonserver (nvidia-pytriton's bundled 2.51 on CPU): a tiny random
Qwen3 target with a real byte-level BPE tokenizer + a random DFlash drafter, served from the
filled model_repo templates on free loopback ports, driven over gRPC by DFlashClient."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request

import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed (pip install 'dflash-trt[serve]')")

from conftest import processes_mentioning, tiny_pair_dir  # noqa: E402

from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.decoding.loop import generate_baseline  # noqa: E402
from dflash_trt.serving.client import DFlashClient, ServingError  # noqa: E402
from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo  # noqa: E402
from dflash_trt.serving.server import ServerError, TritonServer  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # a server start is ~15 s on 2 CPU cores
    pytest.mark.usefixtures("one_torch_thread"),
]  # conftest.py
BLOCK = 4
MAX_SEQ = 256
PROMPTS = [
    "hello world",
    "The quick brown fox",
    "def add(a, b):",
    "héllo wörld ✓ 漢字",
    "Speculative decoding",
    "a",
    "return a + b",
    "lazy dog jumps",
    "ünïcode",
    "The",
    "quick quick quick",
    "brown fox jumps over",
    "verifies them.",
    "漢字 漢字",
    "drafts tokens",
    "over the lazy dog and the quick brown fox",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    target = tiny_pair_dir(root, block_size=BLOCK)
    return root, target, TextCodec.from_dir(root / "target")


def tiny_repo(models, name: str, **values):
    """A model repository over the tiny pair (fp32, one unary instance, one thread, plain prompts
    unless a request asks for the chat template)."""
    root, _, _ = models
    kw = dict(dtype="float32", max_seq_len=MAX_SEQ, unary_instance_count=1, cpu_threads=1, apply_chat_template=False)
    return fill_model_repo(
        default_template_dir(), root / name, default_values(root / "target", root / "drafter", **{**kw, **values})
    )


@pytest.fixture(scope="module")
def server(models):
    repo = tiny_repo(models, "repo", max_batch=8)
    with TritonServer(repo, startup_timeout=300) as srv:
        pid = srv.proc.pid
        yield srv
    assert srv.proc is None and not os.path.exists(f"/proc/{pid}")
    assert not processes_mentioning(str(repo)), "backend stubs left running"


@pytest.fixture(scope="module")
def client(server):
    with DFlashClient(server.grpc_url) as c:
        yield c


def expected(models, prompt: str, max_tokens: int, chat: bool = False) -> str:
    _, target, codec = models
    ids = codec.encode(prompt, chat)
    toks = generate_baseline(target, [ids], SamplingParams(max_new_tokens=max_tokens)).tokens[0]
    return codec.decode(toks), len(toks), len(ids)


def metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r"^(dflash_\w+)\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_cancelled(server, before: float) -> None:
    """Until the server has counted a cancelled request past `before` and runs none (60 s at most)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        m = metrics(server)
        if m.get("dflash_cancelled_requests_total", 0) > before and m.get("dflash_running_requests", 1) == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"cancelled request not freed: {metrics(server)}")


def test_greedy_text_equals_in_process_baseline(models, client):
    for prompt, n in [("hello world", 24), ("héllo wörld ✓ 漢字", 40)]:
        text, n_out, n_in = expected(models, prompt, n)
        r = client.generate(prompt, max_tokens=n)
        assert r["text"] == text
        assert (r["num_output_tokens"], r["num_input_tokens"]) == (n_out, n_in)
        assert r["finish_reason"] in ("length", "stop")
    chat_text, _, n_in = expected(models, "hi there", 12, chat=True)
    r = client.generate("hi there", max_tokens=12, apply_chat_template=True)
    assert r["text"] == chat_text and r["num_input_tokens"] == n_in


def test_seeded_sampling_is_reproducible(client):
    a = client.generate("hello world", max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    b = client.stream_text("hello world", max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    assert a["text"] == b["text"] and a["num_output_tokens"] == 16


@pytest.mark.parametrize("model", ["dflash_bls", "ensemble"])
def test_streamed_chunks_concatenate_to_the_whole_text(models, client, model):
    prompt = "héllo wörld ✓ 漢字"
    whole = client.generate(prompt, max_tokens=48)
    chunks = list(client.stream(prompt, max_tokens=48, model=model))
    assert len(chunks) > 3 and chunks[-1]["final"] and not any(c["final"] for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for k in ("finish_reason", "num_output_tokens", "total_draft_tokens", "total_accepted_draft_tokens"):
        assert chunks[-1][k] == whole[k]
    # the prompt echoed (exclude_input_in_output false) comes first, with the same continuation
    echoed = client.stream_text(prompt, max_tokens=48, model=model, exclude_input_in_output=False)
    assert echoed["text"] == prompt + whole["text"]


def test_acceptance_statistics_are_consistent(client):
    r = client.generate("The quick brown fox", max_tokens=30, return_perf_metrics=True)
    steps, rem = divmod(r["total_draft_tokens"], BLOCK - 1)
    assert rem == 0 and steps >= 1
    acc = r["total_accepted_draft_tokens"]
    assert 0 <= acc <= r["total_draft_tokens"]
    assert r["acceptance_rate"] == pytest.approx(acc / r["total_draft_tokens"])
    assert r["acceptance_length"] == pytest.approx((acc + steps) / steps)
    # one token from the prefill, then (accepted + 1) per verify step, cut at max_tokens
    assert steps + acc < r["num_output_tokens"] <= 1 + steps + acc
    perf = r["perf_metrics"]
    assert perf["e2e_time"] >= perf["time_to_first_token"] > 0 and sum(perf["accept_hist"]) == steps


def test_sixteen_concurrent_requests_each_get_their_own_output(models, client):
    want = {i: expected(models, p, 8 + 3 * i)[0] for i, p in enumerate(PROMPTS)}
    got, errors = {}, []

    def run(i):
        try:
            p = PROMPTS[i]
            if i % 4 == 0:
                got[i] = client.stream_text(p, max_tokens=8 + 3 * i, model="dflash_bls")["text"]
            elif i % 4 == 1:
                got[i] = client.stream_text(p, max_tokens=8 + 3 * i, model="ensemble")["text"]
            else:
                got[i] = client.generate(p, max_tokens=8 + 3 * i)["text"]
        except Exception as e:  # collected: an assert in a thread would be lost
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert got == want


def test_metrics_endpoint_counts_dflash_work(server, client):
    client.generate("hello world", max_tokens=10)
    m = metrics(server)
    for name in (
        "dflash_requests_total",
        "dflash_draft_steps_total",
        "dflash_draft_tokens_total",
        "dflash_output_tokens_total",
    ):
        assert m.get(name, 0) > 0, name
    assert "dflash_accepted_tokens_total" in m and "dflash_running_requests" in m
    assert any(k.startswith("dflash_acceptance_length") for k in m)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(omit=["text_input"]), "text_input"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(prompt="x " * (MAX_SEQ + 10)), "text_input"),
    ],
)
def test_malformed_request_gets_an_error_and_the_next_succeeds(models, client, kw, field):
    kw = {"prompt": "hello world", "max_tokens": 8, **kw}
    with pytest.raises(ServingError, match=field):
        client.generate(**kw)
    with pytest.raises(ServingError, match=field):
        list(client.stream(**kw))
    assert client.generate("hello world", max_tokens=8)["text"] == expected(models, "hello world", 8)[0]


def test_client_disconnect_mid_stream_frees_the_request(models, server, client):
    before = metrics(server).get("dflash_cancelled_requests_total", 0)
    others = {}

    def other(i):
        others[i] = client.stream_text(PROMPTS[i], max_tokens=40)["text"]

    threads = [threading.Thread(target=other, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    gen = client.stream("over the lazy dog", max_tokens=MAX_SEQ - 20)
    seen = [next(gen), next(gen)]
    gen.close()  # stop_stream(cancel_requests=True): the server sees the client go
    assert all(not c["final"] for c in seen)
    for t in threads:
        t.join(300)
    assert others == {i: expected(models, PROMPTS[i], 40)[0] for i in (1, 2)}
    wait_cancelled(server, before)
    assert client.generate("hello world", max_tokens=8)["text"] == expected(models, "hello world", 8)[0]


def test_load_script_reports_percentiles(server):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "load.py"
    for extra in ([], ["--stream"]):
        r = subprocess.run(
            [
                sys.executable,
                str(script),
                "--url",
                server.grpc_url,
                "--requests",
                "6",
                "--concurrency",
                "3",
                "--max-tokens",
                "8",
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["ok"] == 6 and rep["output_tokens"] == 48 and rep["latency_p99_s"] >= rep["latency_p50_s"] > 0
        assert (rep["ttft_p50_s"] > 0) if extra else rep["ttft_p50_s"] != rep["ttft_p50_s"]  # nan when unary


def test_missing_drafter_fails_at_load_naming_the_file(models, tmp_path):
    root, _, _ = models
    repo = fill_model_repo(
        default_template_dir(),
        tmp_path / "repo",
        default_values(root / "target", tmp_path / "no_drafter", dtype="float32", unary_instance_count=1),
    )
    with pytest.raises(ServerError, match=r"no_drafter/config\.json"):
        TritonServer(repo, startup_timeout=300).start()


ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            s = r.get_response_sender()
            for v in x.reshape(-1):
                s.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))]))
            s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_serve_runs_until_sigterm_and_leaves_nothing(tmp_path):
    """`dflash-trt serve`'s function on a trivial decoupled echo repo: ready, streams, stops."""
    import queue
    import signal
    import subprocess
    import sys

    import numpy as np
    import tritonclient.grpc as g

    from dflash_trt.serving.server import free_port

    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    code = (
        f"from dflash_trt.serving.serve_loop import serve; import sys; "
        f"sys.exit(serve({str(tmp_path / 'repo')!r}, {grpc_port}, {http_port}, {metrics_port}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready:") and f"127.0.0.1:{grpc_port}" in line, line
        c = g.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        q = queue.Queue()
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        inp = g.InferInput("IN", [3], "INT32")
        inp.set_data_from_numpy(np.array([7, 8, 9], np.int32))
        c.async_stream_infer("echo", [inp])
        got = [int(q.get(timeout=30)[0].as_numpy("OUT")[0]) for _ in range(3)]
        c.stop_stream()
        c.close()
        assert got == [7, 8, 9]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not processes_mentioning(str(tmp_path / "repo"))


def test_hybrid_proposer_with_cost_length_serves_exact_text(models):
    """A server whose engine copies drafts from each request's own text when that beats the drafter
    (proposer=hybrid) and picks its verify width from the measured cost (draft_length=cost): unary and
    streamed text equal plain greedy decoding, and the response says where the accepted drafts came from."""
    repo = tiny_repo(models, "repo_hybrid", max_batch=4, proposer="hybrid", draft_length="cost")
    with TritonServer(repo, startup_timeout=300) as srv, DFlashClient(srv.grpc_url) as c:
        for prompt, n in [("quick quick quick", 40), ("over the lazy dog and the quick brown fox", 32)]:
            r = c.generate(prompt, max_tokens=n, return_perf_metrics=True)
            assert r["text"] == expected(models, prompt, n)[0]
            src = r["perf_metrics"]["sources"]
            assert src["drafter"]["accepted"] + src["copied"]["accepted"] == r["total_accepted_draft_tokens"]
            streamed = "".join(ch["text"] for ch in c.stream(prompt, max_tokens=n))
            assert streamed == r["text"]
