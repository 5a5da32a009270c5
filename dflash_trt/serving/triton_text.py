"""Triton Python-backend text models: `preprocessing`, `postprocessing` (the ensemble's tokenizer
steps) and the text front doors `dflash_bls` (decoupled) / `dflash_unary` (not decoupled).

Boundary: glue between pb_utils and serving/text.py; imported only inside the backend stub.
Parameters: tokenizer_dir, apply_chat_template (the default when a request does not say),
engine_model (BLS only; default "dflash").

The front doors tokenize in-process, run the `dflash` engine model through BLS (always asking it
to stream, so a client's disconnect is noticed within one step), detokenise with a per-request
StreamDetokenizer, and answer with the TEXT_OUTPUTS of serving/protocol.py. On a cancelled
client they send `dflash` a `cancel_key` request, since BLS response iterators have no cancel
in Triton 2.51. `dflash_unary` waits for all requests of a dynamic batch in parallel threads.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_trt.errors import DFlashError
from dflash_trt.serving.protocol import (
    Progress,
    RequestError,
    TextRequest,
    parse_prompt,
    parse_text_request,
    progress_from,
    text_outputs,
)
from dflash_trt.serving.text import StreamDetokenizer, TextCodec, join_stop_sequences, text_delta
from dflash_trt.serving.triton_dflash import FINAL, input_getter, model_parameters, triton_error

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


def _error_response(message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message))


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
    """text_input (+ stop_words, apply_chat_template) -> input_ids, stop_sequences."""

    def initialize(self, args):
        self.codec, _, _ = _load_codec(args)

    def execute(self, requests):
        return _respond_each(requests, self._encode, (DFlashError,))

    def _encode(self, get) -> dict:
        text, stop_words, chat = parse_prompt(get)
        ids = self.codec.encode(text, chat)
        stops = join_stop_sequences(self.codec.encode_stop_words(stop_words))
        return {"input_ids": np.array([ids], np.int32), "stop_sequences": np.array([stops], np.int32).reshape(1, -1)}


class PostprocessingModel:
    """One engine response (cumulative output_ids, num_prev_tokens, finish_reason) -> the text
    chunk it adds; stateless, so streamed chunks through the ensemble concatenate exactly."""

    def initialize(self, args):
        self.codec, _, _ = _load_codec(args)

    def execute(self, requests):
        return _respond_each(requests, self._decode, (DFlashError, ValueError, UnicodeDecodeError), "postprocessing: ")

    def _decode(self, get) -> dict:
        p = progress_from(get)
        text = text_delta(self.codec, p.output_ids, p.num_prev, final=bool(p.finish_reason))
        return {"text_output": np.array([[text.encode("utf-8")]], dtype=object)}


class _Answer:
    """Where a front door's results go: a decoupled sender, or one slot of a unary batch."""

    def __init__(self, sender=None, request=None):
        self.sender, self.request = sender, request
        self.response = None

    def is_cancelled(self) -> bool:
        try:
            return (self.sender or self.request).is_cancelled()
        except Exception:
            return False

    def send(self, outputs: dict | None, final: bool) -> None:
        if self.sender is None:
            self.response = _response(outputs) if outputs is not None else _error_response("request cancelled")
        elif outputs is None:
            self.sender.send(flags=FINAL)
        else:
            self.sender.send(_response(outputs), flags=FINAL if final else 0)

    def error(self, message: str) -> None:
        if self.sender is None:
            self.response = _error_response(message)
        else:
            self.sender.send(_error_response(message), flags=FINAL)


class BLSModel:
    def initialize(self, args):
        self.codec, params, cfg = _load_codec(args)
        self.engine_model = params.get("engine_model", "dflash") or "dflash"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)

    def execute(self, requests):
        answers, jobs = [], []
        for request in requests:
            answer = _Answer(sender=request.get_response_sender()) if self.decoupled else _Answer(request=request)
            answers.append(answer)
            try:
                jobs.append((parse_text_request(input_getter(request)), answer))
            except RequestError as e:
                answer.error(str(e))
        threads = [threading.Thread(target=self._run, args=job, daemon=True) for job in jobs]
        for t in threads:
            t.start()
        if self.decoupled:
            return None
        for t in threads:
            t.join()
        return [a.response or _error_response("no response") for a in answers]

    def _engine_request(self, req: TextRequest, ids: list[int], key: str):
        s = req.sampling
        t = [
            pb_utils.Tensor("input_ids", np.array([ids], np.int32)),
            pb_utils.Tensor("max_tokens", np.array([[s.max_tokens]], np.int32)),
            pb_utils.Tensor("stream", np.array([[True]], np.bool_)),
            pb_utils.Tensor("temperature", np.array([[s.temperature]], np.float32)),
            pb_utils.Tensor("top_k", np.array([[s.top_k]], np.int32)),
            pb_utils.Tensor("top_p", np.array([[s.top_p]], np.float32)),
            pb_utils.Tensor("return_perf_metrics", np.array([[s.return_perf_metrics]], np.bool_)),
            pb_utils.Tensor("request_key", np.array([[key.encode()]], dtype=object)),
        ]
        if s.seed is not None:
            t.append(pb_utils.Tensor("seed", np.array([[s.seed]], np.uint64)))
        if s.end_id is not None:
            t.append(pb_utils.Tensor("end_id", np.array([[s.end_id]], np.int32)))
        stops = join_stop_sequences(self.codec.encode_stop_words(req.stop_words))
        if stops:
            t.append(pb_utils.Tensor("stop_sequences", np.array([stops], np.int32)))
        return pb_utils.InferenceRequest(model_name=self.engine_model, requested_output_names=_ENGINE_OUTPUTS, inputs=t)

    def _cancel(self, key: str) -> None:
        r = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_key", np.array([[key.encode()]], dtype=object))],
        )
        for _ in r.exec(decoupled=True):
            pass

    def _run(self, req: TextRequest, answer: _Answer) -> None:
        try:
            ids = self.codec.encode(req.text, req.apply_chat_template)
        except DFlashError as e:
            answer.error(str(e))
            return
        key = uuid.uuid4().hex
        detok = StreamDetokenizer(self.codec)
        # exclude_input_in_output false: the text of prompt + output ids, as the ensemble returns it
        prefix = "" if req.exclude_input_in_output else detok.add(ids)
        text, cancelled = "", False
        try:
            for resp in self._engine_request(req, ids, key).exec(decoupled=True):
                if resp.has_error():
                    answer.error(resp.error().message())
                    return
                if not resp.output_tensors():
                    continue  # the empty final flag
                if not cancelled and answer.is_cancelled():
                    cancelled = True
                    self._cancel(key)  # the engine still ends the request with a 'cancelled' response
                if cancelled:
                    continue
                p: Progress = progress_from(lambda n, r=resp: _out(r, n))
                final = bool(p.finish_reason)
                chunk = detok.add(p.output_ids[p.num_prev :], final)
                if prefix:
                    chunk, prefix = prefix + chunk, ""  # noqa: PLW2901
                if req.sampling.stream:
                    if chunk or final:
                        answer.send(text_outputs(chunk, p), final)
                else:
                    text += chunk
                    if final:
                        answer.send(text_outputs(text, p), True)
            if cancelled:
                answer.send(None, True)
        except Exception as e:  # never leave a request without its final response
            answer.error(f"dflash_bls: {type(e).__name__}: {e}")


def _out(resp, name):
    t = pb_utils.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()
