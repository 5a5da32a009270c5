"""What the orchestrator (serving/orchestrator.py) keeps per request and talks to: the Sink a request's
responses go to, the metrics hooks (NullMetrics: the no-op default, serving/triton_dflash.py's
Prometheus metrics implement the same methods), the per-request Job, and the shutdown / queue messages.

Boundary: plain data and protocols; no threads, no engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from dflash_trt.serving.protocol import Progress, TokenRequest

DEFAULT_MAX_QUEUE = 256  # requests waiting for admission before new ones are refused as overloaded
SHUTTING_DOWN = "server is shutting down"
GRACE_EXPIRED = f"{SHUTTING_DOWN}: the request did not finish within the shutdown grace period"


class Sink(Protocol):
    def is_cancelled(self) -> bool: ...
    def send(self, progress: Progress, final: bool) -> None: ...
    def error(self, message: str) -> None: ...  # an error response that also ends the request
    def close(self) -> None: ...  # end without data (the client is gone)


class NullMetrics:
    def request(self) -> None: ...
    def step(self, verify_steps: int, draft_tokens: int, accepted_tokens: int) -> None: ...

    # tokens that reached the client (a stream chunk or a final response sent): not those cut after a stop
    # sequence, nor those of a request cancelled or whose client is gone
    def delivered(self, tokens: int) -> None: ...
    def finished(self, progress: Progress) -> None: ...

    # drafts copied from a row's own text (proposer ngram / hybrid) judged and accepted since the last call
    def copied(self, draft_tokens: int, accepted_tokens: int) -> None: ...

    # a finished request's per-position counts: [i] = its verify steps whose draft i+1 was accepted, and
    # the confidence head's summed predictions of that ([] without a head): decoding/stats.py
    def positions(self, accepted_at: list[int], predicted_at: list[float]) -> None: ...
    def cancelled(self) -> None: ...
    def running(self, n: int) -> None: ...

    # the queue: requests waiting for admission (a gauge, set at each change); the seconds one request
    # waited, when it leaves the queue (admitted or cancelled); a request refused because the queue was full
    def queued(self, n: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def overloaded(self) -> None: ...


@dataclass
class Job:
    key: str
    req: TokenRequest
    sink: Sink
    arrived: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    sent: int = 0
    first_token: float | None = None
    # verify steps, draft tokens, accepted tokens, copied draft tokens, accepted copied tokens already counted
    seen: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    stats: object = None  # the engine's DecodeStats (decoding/stats.py) once it has output
    finish_reason: str = ""

    def progress(self, num_prev: int, perf: dict | None = None) -> Progress:
        s = self.stats
        return Progress(
            list(self.output),
            num_prev,
            self.finish_reason,
            len(self.req.prompt_ids),
            getattr(s, "num_draft_tokens", 0),
            getattr(s, "num_accepted_draft_tokens", 0),
            getattr(s, "num_verify_steps", 0),
            perf,
        )
