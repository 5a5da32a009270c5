"""Triton Python-backend model `dflash`: the engine model (token ids in, ids out); decoupled (one
response per step when streaming), or unary in a `decoupled: false` build (one response per request,
which makes the ensemble over it unary too).

Boundary: glue between pb_utils and the Orchestrator; imported only inside the backend stub
(model_repo/dflash/1/model.py re-exports TritonPythonModel). Model parameters: target_dir,
drafter_dir, engine_backend, max_batch, max_seq_len, dtype, cpu_threads, draft_cutoff, draft_length, proposer,
max_queue (requests waiting for a free batch row before new ones get an "overloaded, retry later" error),
tokenizer_dir (to match text `stop_words`: the request ends at the token that completes one, serving/stops.py).
Every request gets its own response sender; `execute` only parses and queues, the orchestrator's thread sends. A
request holding only `cancel_key` cancels the running request whose `request_key` matches (how the text front doors
propagate a client's disconnect, since BLS response iterators cannot be cancelled in Triton 2.51).
Shutdown: Triton unloads the model (finalize) only once every request has ended, so the orchestrator polls
the drain file of $DFLASH_DRAIN_FILE (serving/server.py writes it before its SIGTERM) and ends the requests
still running after the grace period with "server is shutting down"; finalize then joins its threads.
Custom metrics: dflash_requests_total, dflash_draft_steps_total, dflash_draft_tokens_total,
dflash_accepted_tokens_total, dflash_output_tokens_total (tokens delivered to clients), dflash_cancelled_requests_total,
dflash_copied_draft_tokens_total, dflash_accepted_copied_tokens_total (the drafts copied from the
request's own text, proposer ngram / hybrid, and those accepted; counters), dflash_running_requests
(gauge), dflash_queued_requests (gauge: waiting for admission), dflash_queue_time_seconds_total and
dflash_dequeued_requests_total (seconds waited in the queue, summed, and the requests that left it: their
ratio is the mean time in queue), dflash_overloaded_requests_total (refused: queue full),
dflash_acceptance_length (histogram of tokens per verify step, per finished request),
dflash_accepted_at_position_total{position="i"} (verify steps whose draft i was accepted: over
dflash_draft_steps_total, the per-position acceptance) and, for drafters with a confidence head,
dflash_predicted_at_position_total{position="i"} (the head's summed predictions of the same).
"""

from __future__ import annotations

import json
import logging

import triton_python_backend_utils as pb_utils

from dflash_trt.errors import DFlashError
from dflash_trt.serving.drain import drain_signal_from_env
from dflash_trt.serving.engine_factory import load_engine_factory
from dflash_trt.serving.jobs import DEFAULT_MAX_QUEUE, GRACE_EXPIRED
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import (
    CancelRequest,
    RequestError,
    TokenRequest,
    parse_token_request,
    token_outputs,
)
from dflash_trt.serving.stops import TextStop
from dflash_trt.serving.text import TextCodec

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("dflash_trt.serving")


def input_getter(request):
    def get(name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    return get


def triton_error(message: str, code: str = "INVALID_ARG"):
    c = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message, c) if c is not None else pb_utils.TritonError(message)


def model_parameters(args) -> tuple[dict[str, str], dict]:
    cfg = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}, cfg


class _Sink:
    """Orchestrator sink over one request's InferenceResponseSender (a unary model's too: exactly one
    response, flagged FINAL, per request)."""

    def __init__(self, sender, requested: set[str], decoupled: bool = True):
        self.sender, self.requested, self.decoupled = sender, requested, decoupled
        self.prefix: list[int] = []  # prompt ids to prepend (exclude_input_in_output false)
        self.stop_words: list[str] = []  # echoed for the ensemble's postprocessing
        self.streamed = False  # a response went out already
        self.keyed = False  # the request has a request_key: a text front door's BLS call (or a keyed client)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def send(self, progress, final: bool) -> None:
        outs = token_outputs(progress, self.prefix, self.stop_words)
        tensors = [pb_utils.Tensor(k, v) for k, v in outs.items() if not self.requested or k in self.requested]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
        self.streamed = True

    def error(self, message: str) -> None:
        if self.decoupled and self.streamed and self.keyed:
            # Triton 2.51 (measured): an error response that follows data responses never reaches a BLS
            # caller (the text front doors, which key their requests): flagged FINAL its response iterator
            # hangs, unflagged the error is dropped, and either way the calling model can no longer unload,
            # so the server cannot stop. The bare FINAL flag ends the stream; the front door answers "no
            # final response" with engine_ended_early_message(). (A gRPC client or the ensemble gets the
            # error response fine.)
            log.warning("request ended after streaming: %s", message)
            self.sender.send(flags=FINAL)
        else:
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message)), flags=FINAL)

    def close(self) -> None:
        if self.decoupled:
            self.sender.send(flags=FINAL)
        else:  # a unary request must get one response
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)


def engine_ended_early_message() -> str:
    """For a text front door whose engine response stream ended with no final response (_Sink.error): what
    to tell its client."""
    poll = drain_signal_from_env()
    if poll is not None and poll() is not None:
        return GRACE_EXPIRED
    return "the engine ended the request without a final response (see the server log)"


class _Metrics:
    def __init__(self, labels: dict[str, str], block_size: int):
        self._families = []  # a MetricFamily must outlive its Metrics

        def fam(name, desc, kind):
            f = pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        C = pb_utils.MetricFamily.COUNTER
        self.requests = fam("dflash_requests_total", "Generation requests received", C).Metric(labels=labels)
        self.steps = fam("dflash_draft_steps_total", "Draft/verify steps, summed over requests", C).Metric(
            labels=labels
        )
        self.drafted = fam(
            "dflash_draft_tokens_total", "Draft tokens verified (B-1 a step unless draft_cutoff > 0)", C
        ).Metric(labels=labels)
        self.accepted = fam("dflash_accepted_tokens_total", "Draft tokens accepted", C).Metric(labels=labels)
        self.output = fam("dflash_output_tokens_total", "Tokens delivered to clients", C).Metric(labels=labels)
        self.copied_drafted = fam(
            "dflash_copied_draft_tokens_total", "Draft tokens copied from the request's own text, verified", C
        ).Metric(labels=labels)
        self.copied_accepted = fam("dflash_accepted_copied_tokens_total", "Copied draft tokens accepted", C).Metric(
            labels=labels
        )
        self.cancels = fam(
            "dflash_cancelled_requests_total", "Requests cancelled (client gone or cancel_key)", C
        ).Metric(labels=labels)
        self.gauge = fam(
            "dflash_running_requests", "Requests in the running batch", pb_utils.MetricFamily.GAUGE
        ).Metric(labels=labels)
        self.queue_gauge = fam(
            "dflash_queued_requests", "Requests waiting for admission", pb_utils.MetricFamily.GAUGE
        ).Metric(labels=labels)
        self.queue_seconds = fam(
            "dflash_queue_time_seconds_total", "Seconds requests waited for admission, summed", C
        ).Metric(labels=labels)
        self.dequeued = fam(
            "dflash_dequeued_requests_total", "Requests that left the queue (admitted or cancelled)", C
        ).Metric(labels=labels)
        self.overloads = fam(
            "dflash_overloaded_requests_total", "Requests refused because max_queue requests were waiting", C
        ).Metric(labels=labels)
        self.tau = None
        try:  # histograms need Triton >= 24.08's Python backend
            self.tau = fam(
                "dflash_acceptance_length",
                "Tokens per verify step (bonus included), per request",
                pb_utils.MetricFamily.HISTOGRAM,
            ).Metric(labels=labels, buckets=[float(b) for b in range(1, block_size + 1)])
        except Exception:
            self.tau = fam(
                "dflash_acceptance_length",
                "Tokens per verify step of the last finished request",
                pb_utils.MetricFamily.GAUGE,
            ).Metric(labels=labels)
        self._running = -1
        self._labels = labels
        self._accepted_at: list = []  # per-position counters, made on first use
        self._predicted_at: list = []

    def _per_position(self, metrics: list, name: str, desc: str, n: int) -> list:
        if not metrics and n:
            fam = pb_utils.MetricFamily(name=name, description=desc, kind=pb_utils.MetricFamily.COUNTER)
            self._families.append(fam)
            metrics += [fam.Metric(labels={**self._labels, "position": str(i + 1)}) for i in range(n)]
        return metrics

    def positions(self, accepted_at, predicted_at):
        for metrics, name, desc, values in (
            (
                self._accepted_at,
                "dflash_accepted_at_position_total",
                "Verify steps whose draft at this block position was accepted",
                accepted_at,
            ),
            (
                self._predicted_at,
                "dflash_predicted_at_position_total",
                "Confidence head's summed predicted acceptance of the draft at this position (DSpark drafters)",
                predicted_at,
            ),
        ):
            for m, v in zip(self._per_position(metrics, name, desc, len(values)), values):
                if v:
                    m.increment(v)

    def request(self):
        self.requests.increment(1)

    def step(self, verify_steps, draft_tokens, accepted_tokens):
        for m, v in ((self.steps, verify_steps), (self.drafted, draft_tokens), (self.accepted, accepted_tokens)):
            if v:
                m.increment(v)

    def delivered(self, tokens):
        if tokens > 0:
            self.output.increment(tokens)

    def copied(self, draft_tokens, accepted_tokens):
        for m, v in ((self.copied_drafted, draft_tokens), (self.copied_accepted, accepted_tokens)):
            if v:
                m.increment(v)

    def finished(self, progress):
        if progress.num_verify_steps:
            (self.tau.observe if hasattr(self.tau, "observe") else self.tau.set)(progress.acceptance_length)

    def cancelled(self):
        self.cancels.increment(1)

    def running(self, n):
        if n != self._running:
            self.gauge.set(n)
            self._running = n

    def queued(self, n):
        self.queue_gauge.set(n)

    def waited(self, seconds):
        self.dequeued.increment(1)
        if seconds > 0:
            self.queue_seconds.increment(seconds)

    def overloaded(self):
        self.overloads.increment(1)


class TritonPythonModel:
    def initialize(self, args):
        params, cfg = model_parameters(args)
        # decoupled: false (a `decoupled: false` build) makes a unary engine, so the ensemble over it is unary
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.tokenizer_dir = params.get("tokenizer_dir", "")
        self._codec = None  # for text stop_words, loaded on first use
        threads = int(params.get("cpu_threads", "0") or 0)
        if threads > 0:  # on a busy CPU host, few threads beat OpenMP's spinning barriers by far
            # deferred: the Triton text models import this module and must not load torch
            import torch

            torch.set_num_threads(threads)
        try:
            factory = load_engine_factory(
                params.get("target_dir", ""),
                params.get("drafter_dir", ""),
                params.get("engine_backend", "torch"),
                int(params.get("max_batch", "16")),
                int(params.get("max_seq_len", "2048")),
                params.get("dtype", "auto"),
                float(params.get("draft_cutoff", "0") or 0),
                params.get("draft_length", "block") or "block",
                params.get("proposer") or None,  # None: EngineOptions' default
            )
            # the first engine: a drafter the options do not fit (draft_length=confidence without a
            # confidence head, proposer=hybrid with a DFlash 2 drafter) fails here, at load, with the
            # engine's one-line message
            self.orch = Orchestrator(
                factory,
                max_queue=int(params.get("max_queue", "") or DEFAULT_MAX_QUEUE),
                drain_signal=drain_signal_from_env(),
            )
        except (DFlashError, ValueError) as e:
            raise pb_utils.TritonModelException(f"dflash: cannot load the engine: {e}") from None
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.orch.metrics = _Metrics(labels, self.orch.engine.block_size)
        self.orch.start()

    def execute(self, requests):
        for request in requests:
            sink = _Sink(request.get_response_sender(), set(request.requested_output_names()), self.decoupled)
            try:
                req = parse_token_request(input_getter(request))
                if isinstance(req, TokenRequest):
                    self._check_stream(req)
                    req.text_stop = self._text_stop(req.stop_words)
                    sink.stop_words = req.stop_words
            except (RequestError, DFlashError) as e:
                sink.error(str(e))
                continue
            if isinstance(req, TokenRequest):
                sink.keyed = bool(req.request_key)
            if isinstance(req, TokenRequest) and not req.exclude_input_in_output:
                sink.prefix = list(req.prompt_ids)
            if isinstance(req, CancelRequest):
                self.orch.cancel(req.key)
                sink.close()
            else:
                self.orch.submit(req, sink)
        return None

    def _check_stream(self, req: TokenRequest) -> None:
        if req.sampling.stream and not self.decoupled:
            raise RequestError(
                "stream: this server's models are unary (built with decoupled: false) and answer once; "
                "send stream false, or rebuild with decoupled: true to stream"
            )

    def _text_stop(self, words: list[str]):
        """The request's stop-string matcher (serving/stops.py), or None without stop words."""
        if not words:
            return None
        if self._codec is None:
            if not self.tokenizer_dir:
                raise RequestError("stop_words: the dflash model has no tokenizer_dir parameter to match text with")
            self._codec = TextCodec.from_dir(self.tokenizer_dir)
        return TextStop(self._codec, words).match

    def finalize(self):
        self.orch.stop()
