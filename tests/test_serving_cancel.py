"""Cancels of requests still queued in the engine (issue #41): through every front door that can carry a
cancel (the gRPC stream on dflash_bls, a unary gRPC call on dflash_unary, the OpenAI API streamed and
not), a client that gives up on a request waiting behind a long one is answered within a second,
not at admission. One real tritonserver whose engine runs one request at a time (max_batch 1).
The ensemble cannot carry a cancel to its running engine step (Triton's ensemble scheduler marks only
steps it schedules later; docs/deploy.md), so it is not among the front doors here."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
pytest.importorskip("fastapi", reason="fastapi not installed (pip install 'dflash-trt[serve]')")
openai = pytest.importorskip("openai", reason="openai not installed (pip install 'dflash-trt[test]')")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")

from conftest import tiny_pair_dir  # noqa: E402
from test_serving import BLOCK, metrics, tiny_repo  # noqa: E402

from dflash_trt.serving.client import DFlashClient, build_inputs  # noqa: E402
from dflash_trt.serving.openai_api import OpenAIFrontend  # noqa: E402
from dflash_trt.serving.server import TritonServer  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # conftest.py
LONG = 1900  # tokens of the request that holds the engine's one row (several seconds here)
PROMPT = "over the lazy dog"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_cancel")
    tiny_pair_dir(root, block_size=BLOCK)
    models = (root, None, TextCodec.from_dir(root / "target"))
    repo = tiny_repo(models, "repo_cancel", max_batch=1, max_queue=8, max_seq_len=2048)
    with TritonServer(repo, startup_timeout=300) as srv:
        api = OpenAIFrontend(repo, srv.grpc_url, port=0, model_name="tiny").start()
        try:
            yield srv, api
        finally:
            api.stop()


def _until(what: str, pred, timeout: float = 60.0) -> float:
    """Poll pred() until true; the time it became true (fails after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.02)
    pytest.fail(f"{what}: not within {timeout:g} s")


class _Blocker:
    """A long request on the engine's one row, restarted when it ends, so later requests queue."""

    def __init__(self, srv):
        self.srv, self.stop, self.thread = srv, threading.Event(), None

    def ensure(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        _until("the long request running", lambda: metrics(self.srv).get("dflash_running_requests", 0) >= 1)

    def _run(self) -> None:
        with DFlashClient(self.srv.grpc_url) as c:
            c.generate(PROMPT, max_tokens=LONG, end_id=-1)


def _bls_stream(srv):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    inputs = build_inputs(PROMPT, 8, stream=True)
    client.async_stream_infer("dflash_bls", inputs, request_id="queued", enable_empty_final_response=True)

    def cancel():
        client.stop_stream(cancel_requests=True)
        client.close()

    return cancel


def _unary_grpc(srv):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    ctx = client.async_infer("dflash_unary", build_inputs(PROMPT, 8), callback=lambda result, error: None)

    def cancel():
        ctx.cancel()
        client.close()

    return cancel


def _openai(stream: bool):
    """A raw HTTP request (streamed or not) whose connection closes once the request is queued."""

    def start(srv, api):
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": stream}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock = socket.create_connection(("127.0.0.1", api.port))
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)

        def cancel():
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()

        return cancel

    return start


DOORS = {
    "dflash_bls gRPC stream": lambda srv, api: _bls_stream(srv),
    "dflash_unary gRPC": lambda srv, api: _unary_grpc(srv),
    "OpenAI streamed": _openai(True),
    "OpenAI unary": _openai(False),
}


def test_queued_cancels_are_answered_within_a_second_through_every_front_door(stack):
    srv, api = stack
    blocker = _Blocker(srv)
    took = {}
    for door, start in DOORS.items():
        blocker.ensure()
        before = metrics(srv)
        cancel = start(srv, api)
        _until(f"{door}: request queued", lambda: metrics(srv).get("dflash_queued_requests", 0) >= 1)
        t0 = time.monotonic()
        cancel()
        t1 = _until(
            f"{door}: cancel reached the engine",
            lambda b=before: metrics(srv).get("dflash_cancelled_requests_total", 0)
            > b.get("dflash_cancelled_requests_total", 0),
            timeout=30,
        )
        m = metrics(srv)
        assert m.get("dflash_queued_requests", 0) == 0, (door, m)
        assert m.get("dflash_running_requests", 0) == 1 and blocker.thread.is_alive(), f"{door}: not queued to the end"
        took[door] = t1 - t0
    print("queued cancel answered after (s):", {k: round(v, 3) for k, v in took.items()})
    assert all(t < 1.0 for t in took.values()), took
    blocker.thread.join(120)
    # the server still answers exactly afterwards
    with DFlashClient(srv.grpc_url) as c:
        assert c.generate("hello world", max_tokens=4)["num_output_tokens"] == 4


def test_a_queued_request_whose_client_stays_runs_to_its_end(stack):
    """The watcher only acts on cancelled clients: a queued request that is not cancelled runs to its end."""
    srv, _ = stack
    blocker = _Blocker(srv)
    blocker.ensure()
    got = {}
    t = threading.Thread(target=lambda: got.update(DFlashClient(srv.grpc_url).generate(PROMPT, max_tokens=6)))
    t.start()
    _until("queued", lambda: metrics(srv).get("dflash_queued_requests", 0) >= 1)
    t.join(180)
    assert got["num_output_tokens"] <= 6 and got["finish_reason"] in ("length", "stop")
    assert np.isfinite(got["acceptance_length"]) and blocker.thread.join(120) is None
