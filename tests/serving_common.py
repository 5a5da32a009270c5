"""Shared by the orchestrator test modules (tests/test_serving_units.py, tests/test_serving_queue.py): a
sink that records what a request was sent, and one request served through a fresh Orchestrator."""

from __future__ import annotations

import threading

from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import TokenRequest


class ListSink:
    def __init__(self, cancel_after: int | None = None):
        self.msgs, self.errors, self.closed = [], [], False
        self.done = threading.Event()
        self.cancel_after = cancel_after

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.msgs) >= self.cancel_after

    def send(self, progress, final):
        self.msgs.append((progress, final))
        if final:
            self.done.set()

    def error(self, message):
        self.errors.append(message)
        self.done.set()

    def close(self):
        self.closed = True
        self.done.set()

    def ids(self):
        out = []
        for p, _ in self.msgs:
            out += p.output_ids[p.num_prev :]
        return out


def serve_one(make, request: TokenRequest, timeout: float = 60, **orch_kw):
    """One request through a fresh Orchestrator over `make` -> its last (progress, final) message."""
    orch = Orchestrator(make, **orch_kw).start()
    try:
        sink = ListSink()
        orch.submit(request, sink)
        assert sink.done.wait(timeout) and not sink.errors, sink.errors
    finally:
        orch.stop()
    return sink.msgs[-1]
