"""Triton Python-backend text models: `preprocessing`, `postprocessing` (the ensemble's tokenizer
steps) and the text front doors `dflash_bls` (decoupled) / `dflash_unary` (not decoupled).

Boundary: glue between pb_utils and serving/text.py; imported only inside the backend stub.
Parameters: tokenizer_dir, apply_chat_template (the default when a request does not say),
engine_model (BLS only; default "dflash"), engine_decoupled (BLS only; "false" when the build made
the engine model unary, so it is called with one response per request).

The front doors tokenize in-process, run the `dflash` engine model through BLS (asking a
decoupled engine to stream, so a client's disconnect is noticed within one step), detokenise with
a per-request StreamDetokenizer, and answer with the TEXT_OUTPUTS of serving/protocol.py. On a
cancelled client they send `dflash` a `cancel_key` request, since BLS response iterators have no
cancel in Triton 2.51; a request still queued in the engine (no response yet) is watched by
_QueuedWatch, so its cancel lands within ~0.1 s too, not at admission. Both answer every request
through its response sender as soon as it is done (`execute` returns None), so a short request
never waits for a long one of its dynamic batch.
A request of several rows (batch dimension > 1) runs each row as its own generation and gets one
response with the rows in order. Stop strings (`stop_words`) are text (serving/stops.py): the
engine ends the request at the token completing one, the text is cut before it.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_trt.errors import DFlashError
from dflash_trt.serving.protocol import (
    Progress,
    RequestError,
    TextRequest,
    batch_rows,
    parse_bad_words,
    parse_prompt,
    parse_stop_words,
    parse_text_request,
    progress_from,
    text_outputs,
)
from dflash_trt.serving.stops import clean_stops
from dflash_trt.serving.text import StreamDetokenizer, TextCodec, text_delta
from dflash_trt.serving.triton_dflash import (
    FINAL,
    engine_ended_early_message,
    input_getter,
    model_parameters,
    triton_error,
)
from dflash_trt.serving.trtllm_inputs import ENGINE_FORWARDED, bad_word_variants, flatten_words

QUEUED_CANCEL_POLL = 0.1  # seconds between looks at the clients of requests queued in the engine
_ENGINE_OUTPUTS = [
    "output_ids",
    "num_prev_tokens",
    "finish_reason",
    "num_input_tokens",
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "num_verify_steps",
    "perf_metrics",
]


def _load_codec(args) -> tuple[TextCodec, dict, dict]:
    params, cfg = model_parameters(args)
    chat = params.get("apply_chat_template", "false").strip().lower() in ("1", "true", "yes")
    try:
        return TextCodec.from_dir(params.get("tokenizer_dir", ""), chat), params, cfg
    except DFlashError as e:
        raise pb_utils.TritonModelException(f"{args['model_name']}: {e}") from None


def _response(outputs: dict) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def _error_response(message: str, code: str = "INVALID_ARG") -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message, code))


def _respond_each(requests, outputs, errors: tuple[type[Exception], ...], prefix: str = "") -> list:
    """One response per request: outputs(get) -> its tensors; an exception of `errors` becomes
    that request's error response (prefix + message) and leaves the others alone."""
    out = []
    for request in requests:
        get = input_getter(request)
        try:
            out.append(_response(outputs(get)))
        except errors as e:
            out.append(_error_response(f"{prefix}{e}"))
    return out


class PreprocessingModel:
    """text_input (+ apply_chat_template, bad_words) -> input_ids, bad_words_ids (each bad word's
    token ids, alone and after a space). Stop words go to the engine as text (serving/stops.py)."""

    def initialize(self, args):
        self.codec, _, _ = _load_codec(args)

    def execute(self, requests):
        return _respond_each(requests, self._encode, (DFlashError,))

    def _encode(self, get) -> dict:
        text, _, chat = parse_prompt(get)
        bad = self.codec.encode_stop_words(bad_word_variants(parse_bad_words(get)))
        return {"input_ids": np.array([self.codec.encode(text, chat)], np.int32), "bad_words_ids": flatten_words(bad)}


class PostprocessingModel:
    """One engine response (cumulative output_ids, num_prev_tokens, finish_reason; stop_words and
    num_echoed_tokens, to know what to cut) -> the text chunk it adds;
    stateless, so streamed chunks through the ensemble concatenate exactly."""

    def initialize(self, args):
        self.codec, _, _ = _load_codec(args)

    def execute(self, requests):
        return _respond_each(requests, self._decode, (DFlashError, ValueError, UnicodeDecodeError), "postprocessing: ")

    def _decode(self, get) -> dict:
        p = progress_from(get)
        stops = clean_stops(parse_stop_words(get))
        echoed = get("num_echoed_tokens")  # prompt ids leading output_ids (exclude_input_in_output false)
        num_echoed = int(np.asarray(echoed).reshape(-1)[0]) if echoed is not None else 0
        text = text_delta(self.codec, p.output_ids, p.num_prev, bool(p.finish_reason), stops, num_echoed)
        return {"text_output": np.array([[text.encode("utf-8")]], dtype=object)}


class _Answer:
    """The one request's responses, through its response sender (decoupled or not: Triton 2.51's
    Python backend lets a non-decoupled model answer through the sender too, exactly one response
    flagged FINAL, with `execute` returning None; so each request is answered when it is done,
    not when the slowest request of its dynamic batch is). A request of B rows generates them in
    parallel; a streamed request (one row) sends each chunk, else the rows' final outputs go out
    together in row order."""

    def __init__(self, sender, request, rows: int, stream: bool, decoupled: bool):
        self.sender, self.request, self.stream, self.decoupled = sender, request, stream, decoupled
        self.rows: list[dict | None] = [None] * rows
        self.done = False
        self.lock = threading.Lock()

    def is_cancelled(self) -> bool:
        if self.done:  # another row failed: stop this one too
            return True
        try:
            return self.sender.is_cancelled()
        except Exception:
            try:
                return self.request.is_cancelled()
            except Exception:
                return False

    def chunk(self, row: int, outputs: dict, final: bool) -> None:
        with self.lock:
            if self.done:
                return
            if self.stream:
                self.done = final
                self.sender.send(_response(outputs), flags=FINAL if final else 0)
                return
            if not final:
                return
            self.rows[row] = outputs
            if all(r is not None for r in self.rows):
                self.done = True
                merged = {k: np.concatenate([r[k] for r in self.rows]) for k in self.rows[0]}
                self.sender.send(_response(merged), flags=FINAL)

    def error(self, message: str) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                self.sender.send(_error_response(message), flags=FINAL)

    def cancelled(self) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                if self.decoupled:  # the client is gone: end the stream without data
                    self.sender.send(flags=FINAL)
                else:  # a unary request gets exactly one response
                    self.sender.send(_error_response("request cancelled", "CANCELLED"), flags=FINAL)


class _QueuedWatch:
    """One thread for all of a front door's requests that have no engine response yet. A request waiting
    in the engine's queue gets none, so BLSModel._run would not see its client go before admission (tens of
    seconds under load); this polls their clients and sends the engine the cancel, which ends a waiting
    request at once (answered 'cancelled'). Sent again each second while unanswered: a cancel that
    overtook its request (not yet queued) finds nothing to cancel."""

    def __init__(self, cancel, poll: float = QUEUED_CANCEL_POLL):
        self.cancel, self.poll = cancel, poll
        self.waiting: dict[str, list] = {}  # key -> [answer, when the next cancel may go]
        self.lock, self.stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self._run, name="dflash-bls-queued-cancels", daemon=True).start()

    def add(self, key: str, answer: _Answer) -> None:
        with self.lock:
            self.waiting[key] = [answer, 0.0]

    def remove(self, key: str) -> None:
        with self.lock:
            self.waiting.pop(key, None)

    def close(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self.poll):
            with self.lock:
                entries = list(self.waiting.items())
            for key, entry in entries:
                if time.monotonic() >= entry[1] and entry[0].is_cancelled():
                    entry[1] = time.monotonic() + 1.0
                    try:
                        self.cancel(key)
                    except Exception:  # the engine model is stopping: its drain ends the request anyway
                        pass


class BLSModel:
    def initialize(self, args):
        self.codec, params, cfg = _load_codec(args)
        self.name = args["model_name"]
        self.engine_model = params.get("engine_model", "dflash") or "dflash"
        # false when the build made the engine model unary (decoupled: false): one response per request
        self.engine_streams = params.get("engine_decoupled", "true").strip().lower() != "false"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.queued = _QueuedWatch(self._cancel)

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None  # every response goes through the request's response sender

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        try:
            rows = [parse_text_request(g) for g in batch_rows(input_getter(request), "text_input")]
            stream = rows[0].sampling.stream
            if stream and not self.decoupled:
                raise RequestError(
                    f"stream: {self.name} is not decoupled and answers once; stream with dflash_bls "
                    f"(gRPC streaming API), or send stream false"
                )
            if any(r.return_token_ids for r in rows) and (stream or len(rows) > 1):
                raise RequestError("return_token_ids: only for a request of one row with stream false")
            if stream and len(rows) > 1:
                raise RequestError(
                    f"stream: a streamed request holds one row, got a batch of {len(rows)}; send the rows as "
                    f"separate requests, or stream false"
                )
        except RequestError as e:
            sender.send(_error_response(str(e)), flags=FINAL)
            return
        answer = _Answer(sender, request, len(rows), stream, self.decoupled)
        for i, req in enumerate(rows):
            tag = f"row {i}: " if len(rows) > 1 else ""
            threading.Thread(target=self._run, args=(req, answer, i, tag), daemon=True).start()

    def _engine_request(self, req: TextRequest, ids: list[int], key: str):
        s, p = req.sampling, req.sampling.params
        t = [
            pb_utils.Tensor("input_ids", np.array([ids], np.int32)),
            pb_utils.Tensor("max_tokens", np.array([[s.max_tokens]], np.int32)),
            pb_utils.Tensor("stream", np.array([[self.engine_streams]], np.bool_)),
            pb_utils.Tensor("temperature", np.array([[p.temperature]], np.float32)),
            pb_utils.Tensor("top_k", np.array([[p.top_k]], np.int32)),
            pb_utils.Tensor("top_p", np.array([[p.top_p]], np.float32)),
            pb_utils.Tensor("return_perf_metrics", np.array([[s.return_perf_metrics]], np.bool_)),
            pb_utils.Tensor("request_key", np.array([[key.encode()]], dtype=object)),
        ]
        if p.seed is not None:
            t.append(pb_utils.Tensor("seed", np.array([[p.seed]], np.uint64)))
        if s.end_id is not None:
            t.append(pb_utils.Tensor("end_id", np.array([[s.end_id]], np.int32)))
        for name, dtype in ENGINE_FORWARDED.items():  # tensorrtllm_backend's logit controls (parse_sampling)
            t.append(pb_utils.Tensor(name, np.array([[getattr(p, name)]], dtype)))
        if req.bad_words:
            words = self.codec.encode_stop_words(bad_word_variants(req.bad_words))
            t.append(pb_utils.Tensor("bad_words_ids", flatten_words(words)))
        stops = clean_stops(req.stop_words)
        if stops:  # the engine ends the request at the token completing a stop string (serving/stops.py)
            t.append(pb_utils.Tensor("stop_words", np.array([[w.encode() for w in stops]], dtype=object)))
        return pb_utils.InferenceRequest(model_name=self.engine_model, requested_output_names=_ENGINE_OUTPUTS, inputs=t)

    def _responses(self, request):
        if self.engine_streams:
            yield from request.exec(decoupled=True)
        else:
            yield request.exec()

    def _cancel(self, key: str) -> None:
        if not self.engine_streams:
            return  # a unary engine request cannot be reached once it runs
        r = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_key", np.array([[key.encode()]], dtype=object))],
        )
        for _ in r.exec(decoupled=True):
            pass

    def _run(self, req: TextRequest, answer: _Answer, row: int, tag: str) -> None:
        try:
            ids = self.codec.encode(req.text, req.apply_chat_template)
        except DFlashError as e:
            answer.error(f"{tag}{e}")
            return
        key = uuid.uuid4().hex
        detok = StreamDetokenizer(self.codec)
        # exclude_input_in_output false: the text of prompt + output ids, as the ensemble returns it
        prefix = "" if req.exclude_input_in_output else detok.add(ids)
        detok.watch(req.stop_words)  # stop strings are searched in the output text only
        text, ended = "", False  # ended: answered in full, cancelled, or cut at a stop string here
        if self.engine_streams:  # until the engine's first response; then the loop below sees cancels
            self.queued.add(key, answer)
        try:
            for resp in self._responses(self._engine_request(req, ids, key)):
                self.queued.remove(key)
                if resp.has_error():
                    answer.error(f"{tag}{resp.error().message()}")
                    return
                if not resp.output_tensors() or ended:
                    continue  # the empty final flag, or what follows the end we already sent
                if answer.is_cancelled():
                    ended = True
                    self._cancel(key)  # the engine still ends the request with a 'cancelled' response
                    answer.cancelled()
                    continue
                p: Progress = progress_from(lambda n, r=resp: _out(r, n))
                chunk = detok.add(p.output_ids[p.num_prev :], bool(p.finish_reason))
                if detok.stopped and not p.finish_reason:  # the engine saw no stop yet (an echoed prompt's edge)
                    p.finish_reason, ended = "stop", True
                    self._cancel(key)
                final = bool(p.finish_reason)
                ended = ended or final
                if prefix:
                    chunk, prefix = prefix + chunk, ""  # noqa: PLW2901
                if req.sampling.stream:
                    if chunk or final:
                        answer.chunk(row, text_outputs(chunk, p), final)
                else:
                    text += chunk
                    if final:
                        answer.chunk(row, text_outputs(text, p, req.return_token_ids), True)
            if not ended:  # the engine's stream ended with no final response (its error does not reach BLS)
                answer.error(f"{tag}{engine_ended_early_message()}")
        except Exception as e:  # never leave a request without its final response
            answer.error(f"{tag}{self.name}: {type(e).__name__}: {e}")
        finally:
            self.queued.remove(key)

    def finalize(self):
        self.queued.close()


def _out(resp, name):
    t = pb_utils.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()
