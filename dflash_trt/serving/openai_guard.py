"""What the OpenAI-compatible API checks before a request reaches its route (serving/openai_api.py).

Boundary: an ASGI middleware, no model or Triton knowledge. In order:
  * API key (vLLM's `--api-key`): with a key set, every /v1 path needs `Authorization: Bearer <key>`,
    compared in constant time (hmac.compare_digest); anything else gets 401 with an OpenAI error body.
    /health (and any path outside /v1) stays open, as vLLM's does, for load balancers and probes.
  * media type: a POST body must be `application/json` (415 otherwise, as vLLM answers), not pydantic's
    "Input should be a valid dictionary" for a form-encoded body.
  * body size: a declared Content-Length over `max_body_bytes` gets 413 before the body is used; a
    chunked body is counted as it arrives and refused the same way once it passes the bound. Before the
    413, up to DRAIN_BYTES more of the body are read and dropped (a lingering close, as nginx does): a
    client still sending when the server closes gets a reset instead of the answer (urllib / requests
    then report a broken pipe), so a body only a little over the bound is read through to answer it.
"""

from __future__ import annotations

import hmac
import json

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a whole 128k-token chat fits; a runaway upload does not
API_KEY_ENV = "DFLASH_TRT_API_KEY"
DRAIN_BYTES = 1024 * 1024  # the most of a refused body read (and dropped) so the client hears the 413


class RequestGuard:
    """ASGI middleware: app = RequestGuard(app, api_key, max_body_bytes)."""

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be a positive number of bytes")
        self.app, self.max_body_bytes = app, max_body_bytes
        self._want = f"Bearer {api_key}".encode() if api_key else None

    def authorized(self, header: bytes) -> bool:
        return self._want is None or hmac.compare_digest(header, self._want)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if scope["path"].startswith("/v1") and not self.authorized(headers.get(b"authorization", b"")):
            msg = "missing or incorrect API key: send the header 'Authorization: Bearer <key>' (serve --api-key)"
            return await _reply(send, _api_error(401, msg, None, "invalid_api_key"), {"www-authenticate": "Bearer"})
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
        if media != "application/json":
            msg = f"Content-Type {media or '(none)'!r}: the body must be JSON, sent as 'Content-Type: application/json'"
            return await _reply(send, _api_error(415, msg))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            if int(declared) <= DRAIN_BYTES:
                await _drain(receive, {"more_body": True}, DRAIN_BYTES)
            return await _reply(send, self.too_large(int(declared)))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:  # FastAPI re-raises an HTTPException from reading the body
                    await _drain(receive, message, DRAIN_BYTES)
                    from starlette.exceptions import HTTPException  # deferred: see _api_error

                    raise HTTPException(413, self.too_large(seen).message)
            return message

        return await self.app(scope, counted, send)

    def too_large(self, size: int):
        return _api_error(
            413,
            f"body: {size} bytes is more than this server accepts ({self.max_body_bytes} bytes; "
            "serve --openai-max-body-bytes raises it)",
        )


async def _drain(receive, message: dict, budget: int) -> None:
    """Read and drop the rest of a request body after `message`, at most `budget` bytes."""
    while message.get("type", "http.request") == "http.request" and message.get("more_body") and budget > 0:
        message = await receive()
        budget -= len(message.get("body", b""))


def _api_error(*args):
    # deferred: pydantic and starlette come with the `serve` extra, and the CLI imports this module's constants
    from dflash_trt.serving.openai_schema import ApiError

    return ApiError(*args)


async def _reply(send, e, headers: dict | None = None) -> None:
    body = json.dumps(e.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
