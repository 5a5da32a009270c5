"""The orchestrator's queue without a server, over a fake engine whose steps block: immediate cancel of
waiting requests, and backpressure (max_queue) with the queue-depth metrics (issue #30 items 6, 7)."""

from __future__ import annotations

import threading
import time

import pytest
from serving_common import ListSink

from dflash_trt.decoding.stats import DecodeStats
from dflash_trt.errors import DFlashError
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import Sampling, TokenRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


# ---- queue: immediate cancel of waiting requests, backpressure (issue #30 items 6, 7) ------------
class _FakeOut:
    def __init__(self, key, ids, finished, stats):
        self.request_id, self.new_token_ids, self.finished, self.stats = key, ids, finished, stats
        self.finish_reason = "length" if finished else ""


class _GatedEngine:
    """A fake engine: one token a step (prompt[0] + i), each step blocks while `gate` is closed (a slow step)."""

    class target:
        vocab_size = 1000

    max_seq_len = 64

    def __init__(self, gate: threading.Event, max_batch: int = 2):
        self.gate, self.max_batch, self.rows = gate, max_batch, {}

    def add_requests(self, items):
        for key, ids, params in items:
            self.add_request(key, ids, params)

    def add_request(self, key, ids, params):
        self.rows[key] = [ids[0], params.max_new_tokens, 0]

    def has_unfinished(self):
        return bool(self.rows)

    def cancel(self, key):
        self.rows.pop(key, None)

    def step(self):
        self.gate.wait(5)
        outs = []
        for key, row in list(self.rows.items()):
            row[2] += 1
            done = row[2] >= row[1]
            outs.append(_FakeOut(key, [row[0] + row[2] - 1], done, DecodeStats()))
            if done:
                del self.rows[key]
        return outs


class _QueueMetrics:
    def __init__(self):
        self.depths, self.waits, self.overloads = [], [], 0

    def __getattr__(self, name):  # every other NullMetrics hook: ignored
        return lambda *a, **k: None

    def queued(self, n):
        self.depths.append(n)

    def waited(self, seconds):
        self.waits.append(seconds)

    def overloaded(self):
        self.overloads += 1


def _fill_engine(orch, gate, n):
    running = [ListSink() for _ in range(n)]
    for i, s in enumerate(running):
        orch.submit(TokenRequest([10 * (i + 1)], Sampling(max_tokens=3)), s)
    deadline = time.monotonic() + 5
    while orch.num_running < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert orch.num_running == n
    return running


def test_waiting_request_cancel_is_answered_at_once():
    """With the engine full and its step slow, a waiting request cancelled by key or whose client is gone leaves
    the queue at once, answered as cancelled; the running ones go on (issue #30 item 6)."""
    gate = threading.Event()
    orch = Orchestrator(lambda: _GatedEngine(gate), cancel_poll=0.02).start()
    try:
        running = _fill_engine(orch, gate, 2)
        keyed, gone, later = ListSink(), ListSink(cancel_after=0), ListSink()
        orch.submit(TokenRequest([7], Sampling(max_tokens=2), request_key="q1"), keyed)
        orch.submit(TokenRequest([8], Sampling(max_tokens=2)), gone)
        orch.submit(TokenRequest([9], Sampling(max_tokens=2)), later)
        t0 = time.monotonic()
        orch.cancel("q1")
        assert keyed.done.wait(1) and gone.done.wait(1)
        assert time.monotonic() - t0 < 1 and not gate.is_set()
        assert keyed.msgs == [(keyed.msgs[0][0], True)] and keyed.msgs[0][0].finish_reason == "cancelled"
        assert gone.closed and not gone.msgs and orch.num_waiting == 1 and orch.num_running == 2
        gate.set()
        for s in running + [later]:
            assert s.done.wait(5) and not s.errors
        assert [s.msgs[-1][0].output_ids for s in running] == [[10, 11, 12], [20, 21, 22]]
        assert later.msgs[-1][0].output_ids == [9, 10]
    finally:
        gate.set()
        orch.stop()


def test_queue_is_bounded_and_reports_its_depth():
    """max_queue=Q: with the engine full, Q requests wait, the next is refused at once in one line, the server
    keeps serving and the Q complete; the metrics hook sees the queue depth rise and fall (issue #30 item 7)."""
    gate, metrics, Q = threading.Event(), _QueueMetrics(), 3
    with pytest.raises(DFlashError, match=r"^max_queue=0: must be an integer >= 1"):
        Orchestrator(lambda: _GatedEngine(gate), max_queue=0)
    orch = Orchestrator(lambda: _GatedEngine(gate), metrics=metrics, max_queue=Q).start()
    try:
        running = _fill_engine(orch, gate, 2)
        queued = [ListSink() for _ in range(Q)]
        for i, s in enumerate(queued):
            orch.submit(TokenRequest([100 * (i + 1)], Sampling(max_tokens=2, stream=True)), s)
        extra = ListSink()
        t0 = time.monotonic()
        orch.submit(TokenRequest([5], Sampling(max_tokens=2)), extra)
        assert extra.done.is_set() and time.monotonic() - t0 < 0.5
        assert extra.errors == [f"server overloaded: max_queue={Q} requests already waiting; retry later"]
        assert orch.num_waiting == Q and metrics.overloads == 1 and max(metrics.depths) == Q
        gate.set()
        for s in running + queued:
            assert s.done.wait(5) and not s.errors
        assert [s.ids() for s in queued] == [[100, 101], [200, 201], [300, 301]]
        assert [s.msgs[-1][0].output_ids for s in running] == [[10, 11, 12], [20, 21, 22]]
        after = ListSink()  # room again
        orch.submit(TokenRequest([6], Sampling(max_tokens=1)), after)
        assert after.done.wait(5) and after.msgs[-1][0].output_ids == [6]
    finally:
        gate.set()
        orch.stop()
    top = metrics.depths.index(Q)  # rose one by one to Q, then fell to 0
    assert metrics.depths[top - Q : top + 1] == list(range(Q + 1)) and metrics.depths[-1] == 0
    assert len(metrics.waits) == 2 + Q + 1 and all(w >= 0 for w in metrics.waits)
    assert max(metrics.waits) > 0
