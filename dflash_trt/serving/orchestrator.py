"""The engine model's scheduler: one background thread runs SpecEngine steps over a live batch.

Boundary: continuous batching and request lifecycle, independent of Triton. Requests arrive
from any thread through `submit()` with a Sink (Triton's response sender in production, a list in
tests); between two engine steps the loop admits waiting requests (one batched prefill, up to
`max_batch` running), drops cancelled ones, and sends each request what its last step accepted
(streaming) or everything at the end. The queue is bounded: with `max_queue` requests waiting, the
next one gets an "overloaded, retry" error at once. A waiting request that is cancelled (cancel key,
or its client gone) leaves the queue at once, answered as cancelled, without waiting for the
engine: `cancel()` ends it in the caller's thread, a watcher thread polls the waiting sinks.
Shutdown: `drain(grace)` (or the `drain_signal` hook the watcher polls) refuses new requests at once and
lets the requests already in run for `grace` seconds; then each one left gets one "server is shutting down"
error, so the host (Triton) sees every request end and can unload the model. `stop()` ends the threads.
Only the loop thread touches the engine. A request that
the engine rejects gets an error on its own sink and never affects the others; an unexpected
engine failure fails the running requests and starts a fresh engine.

Stop sequences of several tokens are matched here, on the output ids (single stop tokens are
the engine's), and so are text stop strings, through the request's `text_stop` matcher
(serving/stops.py), so the engine stops at the token that completes one. Metrics go to an
optional object with the hooks of `NullMetrics` (serving/jobs.py, with the Sink protocol and the
per-request Job); the engine factory is serving/engine_factory.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from dflash_trt.decoding.prompt import check_prompt
from dflash_trt.errors import DFlashError
from dflash_trt.serving.jobs import DEFAULT_MAX_QUEUE, GRACE_EXPIRED, SHUTTING_DOWN, Job, NullMetrics, Sink
from dflash_trt.serving.protocol import TokenRequest

log = logging.getLogger("dflash_trt.serving")


class Orchestrator:
    def __init__(
        self,
        engine_factory: Callable[[], object],
        metrics=None,
        idle_wait: float = 0.05,
        max_queue: int = DEFAULT_MAX_QUEUE,
        cancel_poll: float = 0.1,
        drain_signal: Callable[[], float | None] | None = None,
    ):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise DFlashError(f"max_queue={max_queue!r}: must be an integer >= 1 (requests waiting for admission)")
        self.max_queue = max_queue
        self.cancel_poll = cancel_poll
        self._factory = engine_factory
        self.engine = engine_factory()
        self.metrics = metrics or NullMetrics()
        self.idle_wait = idle_wait
        self._cv = threading.Condition()
        self._cancel_keys: set[str] = set()
        self._waiting: deque[Job] = deque()  # the queue, guarded by self._cv
        self._running: dict[str, Job] = {}
        self._ids = itertools.count()
        self._stop = False
        # shutdown: polled by the watcher -> grace seconds once the host is stopping (None until then)
        self._drain_signal = drain_signal
        self._drain_deadline: float | None = None  # time.monotonic() after which the rest get SHUTTING_DOWN
        self._thread = threading.Thread(target=self._loop, name="dflash-step-loop", daemon=True)
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch_waiting, name="dflash-queue-watch", daemon=True)

    # ---- any thread ---------------------------------------------------------------------
    def start(self) -> Orchestrator:
        self._thread.start()
        self._watcher.start()
        return self

    def submit(self, req: TokenRequest, sink: Sink) -> None:
        """Queue a request; errors detectable now are sent on its sink at once."""
        try:  # the engine's own check (decoding/prompt.py), before the request queues
            check_prompt(
                req.prompt_ids,
                self.engine.target.vocab_size,
                self.engine.max_seq_len,
                "input_ids",
                length_field="text_input",
            )
            vocab, end_id = self.engine.target.vocab_size, req.sampling.end_id
            if end_id is not None and end_id >= vocab:  # protocol.py refuses < -1
                raise DFlashError(
                    f"end_id={end_id}: outside the vocabulary 0..{vocab - 1} (give a token id, or -1 to ignore EOS)"
                )
        except DFlashError as e:
            sink.error(str(e))
            return
        key = req.request_key or f"req-{next(self._ids)}"
        self.metrics.request()
        with self._cv:
            refusal = None
            if self._stop or self._drain_deadline is not None:
                refusal = SHUTTING_DOWN
            elif len(self._waiting) >= self.max_queue:
                refusal = f"server overloaded: max_queue={self.max_queue} requests already waiting; retry later"
                self.metrics.overloaded()
            else:
                self._waiting.append(Job(key, req, sink))
                self.metrics.queued(len(self._waiting))
                self._cv.notify()
        if refusal:
            sink.error(refusal)

    def cancel(self, key: str) -> None:
        """Cancel the request with this key: a waiting one is ended here at once, a running one by the loop."""
        with self._cv:
            gone = self._take_waiting(lambda j: j.key == key)
            if not gone:
                self._cancel_keys.add(key)
                self._cv.notify()
        for job in gone:
            self._end_cancelled(job, explicit=True)

    def drain(self, grace: float) -> None:
        """Shutting down: refuse new requests now; end those still waiting or running `grace` seconds from
        now with a "server is shutting down" error. A second call can only bring the deadline closer."""
        deadline = time.monotonic() + max(float(grace), 0.0)
        with self._cv:
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
                self._cv.notify()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._watcher.is_alive():
            self._watcher.join(timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _take_waiting(self, pred) -> list[Job]:
        """Under self._cv: remove the waiting jobs pred selects; they have left the queue."""
        gone = [j for j in self._waiting if pred(j)]
        if gone:
            for j in gone:
                self._waiting.remove(j)
            self._left_queue(gone)
        return gone

    def _left_queue(self, jobs: list[Job]) -> None:
        """Under self._cv: count the time these jobs waited and the queue depth now."""
        now = time.perf_counter()
        for j in jobs:
            self.metrics.waited(now - j.arrived)
        self.metrics.queued(len(self._waiting))

    # ---- watcher thread -----------------------------------------------------------------
    def _watch_waiting(self) -> None:
        """End waiting requests whose client is gone while the loop is busy stepping."""
        while not self._stopped.wait(self.cancel_poll):
            self._poll_drain_signal()
            with self._cv:
                if self._stop:
                    break
                gone = self._take_waiting(lambda j: self._cancelled(j, set()))
            for job in gone:
                self._end_cancelled(job, explicit=False)

    def _poll_drain_signal(self) -> None:
        if self._drain_signal is None:
            return
        try:
            grace = self._drain_signal()
        except Exception:  # a broken hook must not end the watcher (client disconnects depend on it)
            log.warning("drain signal check failed", exc_info=True)
            return
        if grace is not None:
            self.drain(grace)

    # ---- loop thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                if not (self._stop or self._cancel_keys or self._waiting or self._running):
                    self._cv.wait(self.idle_wait)
                if self._stop:
                    break
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    late = self._take_waiting(lambda j: True) + list(self._running.values())
                else:
                    late = []
                cancel, self._cancel_keys = self._cancel_keys, set()
                gone = self._take_waiting(lambda j, keys=cancel: self._cancelled(j, keys))
                free = self.engine.max_batch - len(self._running)
                jobs = [self._waiting.popleft() for _ in range(min(max(free, 0), len(self._waiting)))]
                if jobs:
                    self._left_queue(jobs)
            try:
                self._shed(late, GRACE_EXPIRED)
                for job in gone:
                    self._end_cancelled(job, explicit=job.key in cancel)
                self._drop_cancelled(cancel)
                self._admit(jobs)
                if self.engine.has_unfinished():
                    self._step()
            except Exception as e:  # an engine bug must not kill the loop: fail the batch, start over
                log.exception("engine step failed")
                self._fail_running(f"engine step failed: {type(e).__name__}: {e}")
                self.engine = self._factory()
            self.metrics.running(len(self._running))
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            if waiting:
                self.metrics.queued(0)
        for job in waiting + list(self._running.values()):
            self._safe(job, lambda j: j.sink.error(SHUTTING_DOWN))
        self._running.clear()

    def _shed(self, jobs: list[Job], message: str) -> None:
        """End these jobs (taken from the queue, or running) with an error; the engine frees their rows."""
        for job in jobs:
            if self._running.pop(job.key, None) is not None:
                self.engine.cancel(job.key)
            self._safe(job, lambda j: j.sink.error(message))

    def _safe(self, job: Job, fn) -> bool:
        try:
            fn(job)
            return True
        except Exception:  # the sender is gone (client disconnected): treat as cancelled
            log.warning("request %s: sending failed; dropping it", job.key, exc_info=True)
            return False

    def _cancelled(self, job: Job, keys: set[str]) -> bool:
        if job.key in keys:
            return True
        try:
            return bool(job.sink.is_cancelled())
        except Exception:
            return True

    def _drop_cancelled(self, keys: set[str]) -> None:
        for job in [j for j in self._running.values() if self._cancelled(j, keys)]:
            self.engine.cancel(job.key)
            del self._running[job.key]
            self._end_cancelled(job, explicit=job.key in keys)

    def _end_cancelled(self, job: Job, explicit: bool) -> None:
        job.finish_reason = "cancelled"
        self.metrics.cancelled()
        if explicit:  # the front door that started it still listens: give it a proper end
            self._safe(job, lambda j: j.sink.send(j.progress(j.sent if j.req.sampling.stream else 0), True))
        else:
            self._safe(job, lambda j: j.sink.close())

    def _admit(self, jobs: list[Job]) -> None:
        """Add the jobs just taken from the queue (no more than the free rows) to the engine."""
        if not jobs:
            return
        try:  # one batched prefill; the engine validates every item before touching its state
            self.engine.add_requests([(j.key, j.req.prompt_ids, j.req.sampling.to_params()) for j in jobs])
            self._running.update((j.key, j) for j in jobs)
            return
        except DFlashError:
            pass  # a bad request (or a duplicate key) among them: add one at a time
        except Exception as e:
            for j in jobs:
                self._safe(j, lambda j, e=e: j.sink.error(f"prefill failed: {type(e).__name__}: {e}"))
            raise
        for j in jobs:
            try:
                self.engine.add_request(j.key, j.req.prompt_ids, j.req.sampling.to_params())
                self._running[j.key] = j
            except Exception as e:  # DFlashError names the bad field; anything else is still this request's
                msg = str(e) if isinstance(e, DFlashError) else f"prefill failed: {type(e).__name__}: {e}"
                self._safe(j, lambda j, m=msg: j.sink.error(m))

    def _step(self) -> None:
        now = time.perf_counter()
        for out in self.engine.step():
            job = self._running.get(out.request_id)
            if job is None:  # ended here already (stop sequence, cancel)
                continue
            job.stats = out.stats
            job.output.extend(out.new_token_ids)
            if out.new_token_ids and job.first_token is None:
                job.first_token = now
            # a stop in this step's tokens wins over the engine's own end in the same step (length, EOS after it)
            if self._hit_stop_sequence(job, len(job.output) - len(out.new_token_ids)):
                job.finish_reason = "stop"
                if not out.finished:
                    self.engine.cancel(job.key)
            elif out.finished:
                job.finish_reason = out.finish_reason or "stop"
            self._count(job)
            if job.finish_reason:
                del self._running[job.key]
                self._finish(job)
            elif job.req.sampling.stream and len(job.output) > job.sent:
                if self._safe(job, lambda j: j.sink.send(j.progress(j.sent), False)):
                    self._delivered(job)
                else:
                    self.engine.cancel(job.key)
                    del self._running[job.key]

    def _hit_stop_sequence(self, job: Job, start: int) -> bool:
        """Does a stop sequence (ids) or a stop string (text, req.text_stop) end at a position >= start?
        Truncate the output after the token that completes the first one: what follows is never sent nor counted."""
        keep = job.req.text_stop(job.output, start) if job.req.text_stop is not None else None
        best = None if keep is None else keep - 1
        for seq in job.req.stop_sequences:
            n = len(seq)
            for end in range(max(start, n - 1), len(job.output)):
                if job.output[end - n + 1 : end + 1] == seq:
                    best = end if best is None else min(best, end)
                    break
        if best is None:
            return False
        del job.output[best + 1 :]
        return True

    def _delivered(self, job: Job) -> None:
        """The output up to its end has reached the client: count the part not counted yet."""
        self.metrics.delivered(len(job.output) - job.sent)
        job.sent = len(job.output)

    def _count(self, job: Job) -> None:
        s = job.stats
        now = (
            s.num_verify_steps,
            s.num_draft_tokens,
            s.num_accepted_draft_tokens,
            s.num_copied_draft_tokens,
            s.num_accepted_copied_tokens,
        )
        d = [a - b for a, b in zip(now, job.seen)]
        job.seen = now
        self.metrics.step(d[0], d[1], d[2])
        if d[3] or d[4]:
            self.metrics.copied(d[3], d[4])

    def _finish(self, job: Job) -> None:
        perf = None
        if job.req.sampling.return_perf_metrics:
            s, end = job.stats, time.perf_counter()
            perf = {
                "e2e_time": end - job.arrived,
                "time_to_first_token": (job.first_token or end) - job.arrived,
                "prefill_time": s.prefill_time,
                "draft_time": s.draft_time,
                "verify_time": s.verify_time,
                "accept_hist": list(s.accept_hist),
                "block_size": s.block_size,
                "per_position_acceptance": s.per_position_acceptance,
                "sources": s.sources,  # steps / drafts / accepted per draft source: drafter, copied (decoding/stats.py)
            }
            if s.predicted_tau is not None:  # a drafter with a confidence head (DSpark)
                perf.update(predicted_per_position=s.predicted_per_position, predicted_tau=s.predicted_tau)
        p = job.progress(job.sent if job.req.sampling.stream else 0, perf)
        self.metrics.finished(p)
        self.metrics.positions(list(job.stats.accepted_at), list(job.stats.predicted_at))
        if self._safe(job, lambda j: j.sink.send(p, True)):
            self._delivered(job)

    def _fail_running(self, message: str) -> None:
        for job in list(self._running.values()):
            self._safe(job, lambda j: j.sink.error(message))
        self._running.clear()
