"""OpenAI-compatible HTTP API (FastAPI) in front of a running Triton deployment of the DFlash models.

Boundary: HTTP <-> the decoupled text front door `dflash_bls` over gRPC (tritonclient.grpc.aio,
one gRPC stream per request, so nothing blocks the event loop). Request bodies and response
shapes live in serving/openai_schema.py; tokenizing, decoding, stop words and the engine stay in
the Triton models. This module only renders chat messages with the tokenizer's chat template
(multi-turn chats are more than the front door's one-user-message template) and sends the text
with apply_chat_template=false, maps front-door errors to HTTP statuses, and writes server-sent
events. A client that goes away (mid-stream, or while a non-streamed request runs) gets its
gRPC stream cancelled, and `dflash_bls` then cancels the engine request within one step.

`OpenAIFrontend` runs the app with uvicorn in a thread of `dflash-trt serve` (serving/cli.py),
which imports this module only for --openai-port (fastapi is part of the `serve` extra).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from dflash_trt.errors import DFlashError
from dflash_trt.serving.client import build_inputs, parse_result
from dflash_trt.serving.openai_guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from dflash_trt.serving.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Generation,
    bad,
    chunk_body,
    completion_body,
    models_body,
    new_id,
    usage_chunk,
)
from dflash_trt.serving.repo import RepoInfo, default_model_name
from dflash_trt.serving.text import TextCodec
from dflash_trt.serving.triton_env import local_host

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\]\s*")
_FIELD = re.compile(r"^([a-z_]+)(?=[:=])")
RETRY_AFTER_S = 1  # 503's Retry-After: a full queue frees a row within a few engine steps


def render_chat(codec: TextCodec, messages: list[dict]) -> str:
    """The chat as text which the front door, told apply_chat_template=false, tokenizes to exactly
    the ids `tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)` gives
    (what `dflash-trt generate --chat` runs on). The front door encodes with add_special_tokens=True,
    so a template's own leading BOS is dropped from the text where the tokenizer adds it back."""
    tok = codec.tok
    if not getattr(tok, "chat_template", None):
        raise bad("messages", "the model's tokenizer has no chat template; send a plain prompt to /v1/completions")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 errors and the template's own raise_exception
        raise bad("messages", f"the chat template refused them: {e}") from None
    want = list(tok(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tok, "bos_token", None) or getattr(tok, "special", {}).get("bos_token")
    for candidate in (text, text[len(bos) :] if bos and text.startswith(bos) else None):
        if candidate and list(tok(candidate, add_special_tokens=True)["input_ids"]) == want:
            return candidate
    raise ApiError(500, "messages: the rendered chat does not survive the text model's tokenization unchanged")


def server_error(message: str, chat: bool, max_field: str = "max_tokens") -> ApiError:
    """A front-door error message -> the HTTP error: 400 when it names a request field (renamed to
    the API's field), 503 when overloaded or stopping, else 500."""
    message = _REQUEST_ID.sub("", message)
    m = _FIELD.match(message)
    rename = {
        "text_input": "messages" if chat else "prompt",
        "input_ids": "messages" if chat else "prompt",
        "apply_chat_template": "messages",
        "max_tokens": max_field,
        "stop_words": "stop",
        "end_id": "ignore_eos",
    }
    known = {"temperature", "top_p", "top_k", "seed", "min_tokens", "bad_words", *rename}
    known |= {"presence_penalty", "frequency_penalty", "repetition_penalty"}
    if m and m.group(1) in known:
        param = rename.get(m.group(1), m.group(1))
        return ApiError(400, param + message[len(m.group(1)) :], param)
    unavailable = ("overloaded", "shutting down", "stopping", "unavailable", "no available versions")
    if any(w in message.lower() for w in unavailable):  # full queue, or Triton draining on SIGTERM
        return ApiError(503, message)
    return ApiError(500, message)


class _Call:
    """One request on the decoupled text front door, over its own gRPC stream."""

    def __init__(self, client, model: str, inputs: list, chat: bool, max_field: str):
        self.chat, self.max_field, self.done = chat, max_field, False

        async def one():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        self._it = client.stream_infer(one())

    async def next(self) -> dict:
        """The next front-door response (parse_result's dict); its finish_reason is set on the last."""
        import grpc  # deferred: optional dependency (the `serve` extra)

        try:
            result, error = await self._it.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise ApiError(502, "the text model ended the stream without a final response") from None
        except grpc.RpcError as e:
            self.done = True
            detail = e.details() if hasattr(e, "details") else str(e)
            raise ApiError(503, f"Triton server unreachable: {detail}") from None
        if error is not None:
            self.done = True
            raise server_error(error.message() or str(error), self.chat, self.max_field)
        res = parse_result(result)
        self.done = bool(res["finish_reason"])
        return res

    def close(self) -> None:
        """Cancel the gRPC stream of a running request (dflash_bls then cancels the engine request);
        idempotent. A finished request's stream is left to end by itself: cancelling it makes
        Triton 2.51 keep dflash_bls from unloading, so `serve` hangs 40 s on SIGTERM and exits 1."""
        if not self.done:
            self.done = True
            self._it.cancel()


async def _unless_disconnected(request, aw):
    """await aw, or None as soon as the HTTP client has gone (aw is cancelled then)."""
    task = asyncio.ensure_future(aw)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(
    grpc_url: str,
    model_name: str,
    repo: RepoInfo,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
):
    """The FastAPI app behind its RequestGuard (API key, media type, body size: serving/openai_guard.py);
    its gRPC client opens with the app's lifespan (on uvicorn's event loop)."""
    import tritonclient.grpc.aio as grpc_aio  # deferred: optional dependency (the `serve` extra)

    codec = TextCodec.from_dir(repo.tokenizer_dir)
    # a prompt longer than this many characters holds more than max_seq_len tokens: refused untokenized
    max_chars = repo.max_seq_len * codec.max_token_chars
    created = int(time.time())
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["client"] = grpc_aio.InferenceServerClient(grpc_url)
        try:
            yield
        finally:
            await state["client"].close()

    app = FastAPI(title="dflash-trt OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        retry = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None  # overloaded or stopping
        return JSONResponse(e.body(), status_code=e.status, headers=retry)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return JSONResponse(validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{model_name}`)", "model")

    @app.get("/health")
    async def health():
        try:
            ok = await state["client"].is_server_ready()
        except Exception:
            ok = False
        return JSONResponse({"ready": bool(ok)}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return models_body(model_name, created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return models_body(model_name, created)["data"][0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        gen = body.to_generation(repo.max_seq_len)
        check_length("prompt", len(gen.prompt))
        gen.inputs["apply_chat_template"] = False  # completions are raw prompts whatever the repo's default
        return await respond(request, gen, chat=False, max_field="max_tokens")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        gen = body.to_generation(repo.max_seq_len)
        messages = body.template_messages()
        check_length("messages", sum(len(m.get("content") or "") for m in messages))
        gen.prompt = await asyncio.to_thread(render_chat, codec, messages)
        gen.inputs["apply_chat_template"] = False
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await respond(request, gen, chat=True, max_field=max_field)

    def check_length(param: str, chars: int) -> None:
        if chars > max_chars:  # before any tokenizer sees it (a huge body would take seconds to tokenize)
            raise bad(
                param,
                f"{chars} characters cannot fit max_seq_len={repo.max_seq_len} tokens (no token of this model "
                f"covers more than {codec.max_token_chars} characters); shorten it",
            )

    async def respond(request, gen: Generation, chat: bool, max_field: str):
        # the unary front door (a decoupled: false build) answers once: a streamed request gets one chunk
        inputs = build_inputs(gen.prompt, gen.max_tokens, stream=gen.stream and repo.streams, **gen.inputs)
        call = _Call(state["client"], repo.front_door, inputs, chat, max_field)
        rid, now = new_id(chat), int(time.time())
        try:  # the first response before any header: a refused request gets its HTTP status
            first = await _unless_disconnected(request, call.next())
        except BaseException:
            call.close()
            raise
        if first is None or not gen.stream:
            call.close()
            if first is None:
                return JSONResponse({}, status_code=499)
            if gen.inputs.get("return_token_ids"):  # the ids the front door encoded the prompt to (same codec)
                first["prompt_ids"] = await asyncio.to_thread(codec.encode, gen.prompt, False)
            return completion_body(rid, model_name, chat, first)
        return StreamingResponse(
            events(call, first, gen, rid, now, chat),
            media_type="text/event-stream",
            background=BackgroundTask(call.close),  # runs after a disconnect cancelled the stream too
        )

    async def events(call: _Call, res: dict, gen: Generation, rid: str, now: int, chat: bool):
        try:
            if chat:
                yield _sse(chunk_body(rid, model_name, chat, now, None, None, role=True))
            while True:
                final = bool(res["finish_reason"])
                if res["text"] or final:
                    yield _sse(chunk_body(rid, model_name, chat, now, res["text"], res if final else None))
                if final:
                    break
                try:
                    res = await call.next()
                except ApiError as e:  # the status line is gone: the error travels as an event
                    yield _sse(e.body())
                    break
            if final and gen.usage_in_stream:
                yield _sse(usage_chunk(rid, model_name, chat, now, res))
            yield "data: [DONE]\n\n"
        finally:
            call.close()

    return RequestGuard(app, api_key, max_body_bytes)


def validation_error(errors) -> ApiError:
    """pydantic's first error as one OpenAI error: param = the field's path, e.g. messages[0].role."""
    e = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    parts = []
    for p in list(e.get("loc", ()))[1:]:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _TYPE_TAGS or not p.isidentifier():
            break  # a union member's tag, not a field
        else:
            parts.append(("." if parts else "") + p)
    param = "".join(parts) or None
    if e.get("type") == "json_invalid":
        return ApiError(400, f"body: not valid JSON ({e.get('msg')})", None)
    return ApiError(400, f"{param or 'body'}: {e.get('msg')}", param)


class OpenAIFrontend:
    """The API on uvicorn in a daemon thread of the serve process. The port is bound at once (a
    taken port fails before Triton spends minutes loading); start() listens, after Triton is ready."""

    def __init__(
        self,
        model_repo,
        grpc_url: str,
        host: str = "127.0.0.1",
        port: int = 8080,
        model_name=None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.repo = model_repo if isinstance(model_repo, RepoInfo) else RepoInfo.read(model_repo)
        if model_name is None and not isinstance(model_repo, RepoInfo):
            model_name = default_model_name(model_repo, self.repo.target_dir)
        self.model_name = model_name or self.repo.target_dir.name
        self.host, self.grpc_url = host, grpc_url
        # fails now on a bad tokenizer
        self.app = create_app(grpc_url, self.model_name, self.repo, api_key or None, max_body_bytes)
        self._server = self._thread = None
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise DFlashError(f"--openai-port {port}: cannot listen on {host} ({e.strerror})") from None
        self.port = self._sock.getsockname()[1]  # port 0: the one the OS picked

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the API (all interfaces: through loopback)."""
        return f"http://{local_host(self.host)}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> OpenAIFrontend:
        import uvicorn  # deferred: optional dependency (the `serve` extra)

        cfg = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise DFlashError(f"OpenAI API on {self.url} did not start (see the log lines above)")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop uvicorn (requests still open get 5 s) and release the port; idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None
        self._sock.close()

    def on_ready(self, _server=None) -> str:
        """serving/server.py serve()'s on_ready: start listening once Triton is ready; the text for its ready line."""
        if self._server is None:
            self.start()
        return f"  OpenAI {self.url} (model {self.model_name})"
