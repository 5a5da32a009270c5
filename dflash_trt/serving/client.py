"""DFlashClient: text generation against the Triton model repository over gRPC (tritonclient).

Boundary: client side only. `generate()` is one unary `infer` on the non-decoupled front door
(`dflash_unary` by default), `generate_batch()` one such call holding one row per prompt
(answered in prompt order); `stream()` opens a gRPC stream (`start_stream` /
`async_stream_infer`) on a decoupled one (`dflash_bls`, or `ensemble`) and yields text chunks
with running acceptance statistics; leaving the iterator early cancels the request on the
server (`stop_stream(cancel_requests=True)`). Each `stream()` uses its own gRPC connection, so
one DFlashClient can drive many streams from many threads. Server errors raise ServingError
carrying the server's message (which names the bad field).
"""

from __future__ import annotations

import json
import queue
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from dflash_trt.errors import DFlashError
from dflash_trt.serving.protocol import STAT_OUTPUTS
from dflash_trt.serving.trtllm_inputs import ENGINE_FORWARDED


class ServingError(DFlashError):
    """The server answered a request with an error (or could not be reached)."""


def _grpc():
    try:
        # deferred: optional dependency (the `serve` extra)
        import tritonclient.grpc as grpcclient
    except ImportError:
        raise DFlashError("tritonclient is not installed: pip install 'dflash-trt[serve]'") from None
    return grpcclient


def _tensor(g, name: str, value: np.ndarray):
    dtype = {
        np.dtype(np.int32): "INT32",
        np.dtype(np.float32): "FP32",
        np.dtype(np.bool_): "BOOL",
        np.dtype(np.uint64): "UINT64",
    }.get(value.dtype, "BYTES")
    t = g.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def input_arrays(
    prompt: str,
    max_tokens: int,
    *,
    stream: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_words: Sequence[str] | None = None,
    end_id: int | None = None,
    exclude_input_in_output: bool = True,
    return_perf_metrics: bool = False,
    apply_chat_template: bool | None = None,
    return_token_ids: bool = False,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    bad_words: Sequence[str] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    omit: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """The input arrays (one row each) of a text front door; tensorrtllm_backend's logit controls when
    given (serving/trtllm_inputs.py); `extra` adds raw [1, ...] arrays by name, `omit` drops named inputs."""
    vals = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=object),
        "max_tokens": np.array([[max_tokens]], np.int32),
        "stream": np.array([[stream]], np.bool_),
        "temperature": np.array([[temperature]], np.float32),
        "top_k": np.array([[top_k]], np.int32),
        "top_p": np.array([[top_p]], np.float32),
        "exclude_input_in_output": np.array([[exclude_input_in_output]], np.bool_),
        "return_perf_metrics": np.array([[return_perf_metrics]], np.bool_),
    }
    if seed is not None:
        vals["seed"] = np.array([[seed]], np.uint64)
    if stop_words:
        vals["stop_words"] = np.array([[w.encode("utf-8") for w in stop_words]], dtype=object)
    if end_id is not None:
        vals["end_id"] = np.array([[end_id]], np.int32)
    if apply_chat_template is not None:
        vals["apply_chat_template"] = np.array([[apply_chat_template]], np.bool_)
    if return_token_ids:  # dflash_bls / dflash_unary: the final response carries output_ids
        vals["return_token_ids"] = np.array([[True]], np.bool_)
    given = dict(
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
    )
    for name, dtype in ENGINE_FORWARDED.items():
        if given[name] is not None:
            vals[name] = np.array([[given[name]]], dtype)
    if bad_words:
        vals["bad_words"] = np.array([[w.encode("utf-8") for w in bad_words]], dtype=object)
    vals.update(extra or {})
    return {k: v for k, v in vals.items() if k not in omit}


def build_inputs(prompt: str, max_tokens: int, **kw) -> list:
    """InferInputs for a text front door (input_arrays' keywords)."""
    g = _grpc()
    return [_tensor(g, k, v) for k, v in input_arrays(prompt, max_tokens, **kw).items()]


def batch_inputs(rows: Sequence[dict[str, np.ndarray]]) -> list:
    """InferInputs of one request holding several rows (input_arrays each, same keys), row order kept;
    stop_words / bad_words rows of different lengths are padded with empty strings (which the server drops)."""
    g = _grpc()
    keys = list(rows[0])
    if any(list(r) != keys for r in rows):
        raise DFlashError(
            "batch rows: every row must set the same inputs (give stop_words, seed, end_id to all or none)"
        )
    out = []
    for k in keys:
        col = [r[k] for r in rows]
        if k in ("stop_words", "bad_words"):
            width = max(a.shape[1] for a in col)
            col = [np.concatenate([a, np.full((1, width - a.shape[1]), b"", dtype=object)], axis=1) for a in col]
        out.append(_tensor(g, k, np.concatenate(col)))
    return out


def parse_result(result, row: int = 0) -> dict:
    """InferResult -> {text, finish_reason, <acceptance statistics>, perf_metrics} of one row."""

    def one(name):
        a = result.as_numpy(name)
        return None if a is None else a.reshape(a.shape[0], -1)[row][0]

    out = {
        "text": (one("text_output") or b"").decode("utf-8"),
        "finish_reason": (one("finish_reason") or b"").decode("utf-8"),
    }
    for k in STAT_OUTPUTS:
        v = one(k)
        out[k] = None if v is None else (float(v) if k.startswith("acceptance") else int(v))
    perf = one("perf_metrics")
    out["perf_metrics"] = json.loads(perf) if perf else None
    ids = result.as_numpy("output_ids")  # only when the request asked (return_token_ids)
    if ids is not None:
        out["output_ids"] = [int(t) for t in ids.reshape(ids.shape[0], -1)[row]]
    return out


class DFlashClient:
    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = "dflash_unary",
        stream_model: str = "dflash_bls",
        timeout: float | None = None,
    ):
        self.url, self.model, self.stream_model, self.timeout = url, model, stream_model, timeout
        self._client = _grpc().InferenceServerClient(url)

    def is_ready(self) -> bool:
        try:
            return self._client.is_server_ready() and self._client.is_model_ready(self.model)
        except Exception:
            return False

    def generate(
        self, prompt: str, max_tokens: int = 128, temperature: float = 0.0, model: str | None = None, **kw
    ) -> dict:
        """Whole completion in one unary call -> result dict (text + acceptance statistics)."""
        # deferred: optional dependency (the `serve` extra)
        from tritonclient.utils import InferenceServerException

        inputs = build_inputs(prompt, max_tokens, temperature=temperature, stream=False, **kw)
        try:
            res = self._client.infer(model or self.model, inputs, client_timeout=self.timeout)
        except InferenceServerException as e:
            raise ServingError(e.message() or str(e)) from None
        return parse_result(res)

    def generate_batch(
        self, prompts: Sequence[str], max_tokens: int = 128, temperature: float = 0.0, model: str | None = None, **kw
    ) -> list[dict]:
        """One unary request holding one row per prompt (each its own generation) -> results in prompt order."""
        # deferred: optional dependency (the `serve` extra)
        from tritonclient.utils import InferenceServerException

        rows = [input_arrays(p, max_tokens, temperature=temperature, stream=False, **kw) for p in prompts]
        try:
            res = self._client.infer(model or self.model, batch_inputs(rows), client_timeout=self.timeout)
        except InferenceServerException as e:
            raise ServingError(e.message() or str(e)) from None
        return [parse_result(res, i) for i in range(len(prompts))]

    def stream(
        self, prompt: str, max_tokens: int = 128, temperature: float = 0.0, model: str | None = None, **kw
    ) -> Iterator[dict]:
        """Yield chunks ({text, final, finish_reason, statistics...}) as the server accepts tokens.
        The chunks' texts concatenate to generate()'s text. Closing the iterator early cancels."""
        # deferred: optional dependency (the `serve` extra)
        from tritonclient.utils import InferenceServerException

        g = _grpc()
        inputs = build_inputs(prompt, max_tokens, temperature=temperature, stream=True, **kw)
        q: queue.Queue = queue.Queue()
        client = g.InferenceServerClient(self.url)
        done = False
        try:
            client.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=self.timeout)
            client.async_stream_infer(
                model or self.stream_model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
            while not done:
                result, error = q.get(timeout=self.timeout)
                if error is not None:
                    done = True
                    msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise ServingError(msg)
                resp = result.get_response()
                done = resp.parameters["triton_final_response"].bool_param
                if resp.outputs:
                    chunk = parse_result(result)
                    chunk["final"] = done
                    yield chunk
        finally:
            try:
                client.stop_stream(cancel_requests=not done)
            finally:
                client.close()

    def stream_text(self, prompt: str, max_tokens: int = 128, **kw) -> dict:
        """Run stream() to the end; the last chunk's statistics with the concatenated text."""
        text, last = [], {}
        for chunk in self.stream(prompt, max_tokens, **kw):
            text.append(chunk["text"])
            last = chunk
        return {**last, "text": "".join(text), "chunks": len(text)}

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> DFlashClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
