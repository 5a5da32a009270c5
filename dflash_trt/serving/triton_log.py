"""Reading tritonserver's own log while it stops: which models its unload is stuck on, with nothing left to run.

Boundary: text parsing only (serving/server.py owns the process and decides what to do).

Why (issue #41, measured with Triton 2.51, confirmed in its source): when Triton refuses a request on
a gRPC stream *after* creating it (mismatched batch sizes across inputs, a missing or mistyped input,
...: `TRITONSERVER_ServerInferAsync` fails), its gRPC frontend (src/grpc/stream_infer_handler.cc) keeps
that request in the stream's state, and the request holds its model. A stream that then ends normally
releases the state; a stream the client cancels (`stop_stream(cancel_requests=True)`) does not:
`IssueRequestCancellation` only visits requests that were admitted, so the refused one stays, and with
it the model. On SIGTERM Triton waits for every model to unload before it stops the gRPC server, the one
thing that would free the request: the wait runs its whole exit timeout ("Found 1 live models"), the
model never unloads, and Triton exits 1 ("Exit timeout expired"). Nothing can be in flight then (Triton
reported none before it began unloading), so serving/server.py ends the process once the unload has
made no progress for STUCK_UNLOAD_S and reports the models by name (those never "successfully unloaded").
"""

from __future__ import annotations

import re

STUCK_UNLOAD_S = 5.0  # seconds the live-model count may stand still (nothing in flight) before it counts as stuck
_UNLOADING = "All models are stopped, unloading models"
_LIVE = re.compile(r"Timeout \d+: Found (\d+) live models and (\d+) in-flight non-inference requests")
_UNLOADED = re.compile(r"successfully unloaded '([^']+)' version")
_LOADED = re.compile(r"successfully loaded '([^']+)'")


def live_models(log: str) -> int | None:
    """The live-model count of the last unload-wait line, once Triton has begun unloading with no
    inference in flight and no non-inference request; None before that (or while one is in flight)."""
    if _UNLOADING not in log:
        return None
    found = _LIVE.findall(log[log.index(_UNLOADING) :])
    if not found or int(found[-1][1]):
        return None
    return int(found[-1][0])


def unloaded_models(log: str) -> set[str]:
    return set(_UNLOADED.findall(log))


def loaded_models(log: str) -> set[str]:
    return set(_LOADED.findall(log))


class UnloadWatch:
    """Fed the log text written since the SIGTERM, again and again (`update(text, now)`); `stuck` turns
    true once the live-model count stood still, above zero, for STUCK_UNLOAD_S."""

    def __init__(self, stuck_after: float = STUCK_UNLOAD_S):
        self.stuck_after = stuck_after
        self._count: int | None = None
        self._since = 0.0

    def update(self, log: str, now: float) -> bool:
        count = live_models(log)
        if count != self._count:
            self._count, self._since = count, now
        return bool(self._count) and now - self._since >= self.stuck_after
