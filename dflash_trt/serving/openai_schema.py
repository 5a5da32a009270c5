"""OpenAI-compatible request and response bodies of the HTTP API (serving/openai_api.py).

Boundary: pure data, no HTTP server and no Triton client. Requests are pydantic models that
accept what the OpenAI API (and vLLM's extensions `top_k`, `ignore_eos`, `repetition_penalty`,
`min_tokens`, `bad_words`) accepts for `/v1/completions` and `/v1/chat/completions`;
`to_generation()` turns one into the text front door's inputs (serving/client.py build_inputs)
and refuses, as ApiError naming the field, what this server cannot do (n > 1, logprobs,
logit_bias, tools, token-id prompts). Responses are plain dicts in the OpenAI shape plus a
`dflash` object with the request's acceptance statistics; with `return_token_ids` (vLLM and SGLang's
extension) the choice also carries `prompt_token_ids` and `token_ids` (not streamed).

Defaults are OpenAI's, not the Triton models': temperature 1.0 (send 0 for greedy, which is
exact), max_tokens 16 for completions, and for chat the rest of the context (max_seq_len).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.config import SamplingParams
from dflash_trt.errors import DFlashError

ROLES = ("system", "developer", "user", "assistant", "tool")
# the OpenAI API's own bounds, narrower than what the engine takes (SamplingParams checks the rest)
OPENAI_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2)}
# accepted and ignored: they change nothing about the generated text
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


class ApiError(Exception):
    """An error the client sees as {"error": {message, type, param, code}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status == 503:  # queue full, server stopping, Triton unreachable: retry later
            return "service_unavailable"
        return "invalid_request_error" if self.status < 500 else "internal_server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    """HTTP 400 for one field; the message starts with the field name."""
    return ApiError(400, f"{param}: {message}", param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, the final chunk carries the usage


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0 disables it
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension, as the next two
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM / SGLang extension: the response's choice also carries prompt_token_ids and token_ids
    return_token_ids: bool | None = None

    def _usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _common(self, max_tokens: int | None, max_field: str, max_seq_len: int) -> dict:
        """Validated inputs every request kind sends (serving/client.py build_inputs keywords)."""
        if self.n not in (None, 1):
            raise bad("n", f"n={self.n}: this server returns one choice per request; send n=1 (or leave it out)")
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options", "only allowed with stream=true")
        if self.return_token_ids and self.stream:
            raise bad("return_token_ids", "only with stream=false")
        if self.logit_bias:
            raise bad("logit_bias", "not supported; leave it out")
        if max_tokens is not None and max_tokens < 1:
            raise bad(max_field, f"{max_field}={max_tokens}: must be >= 1")
        for name, (lo, hi) in OPENAI_RANGES.items():
            v = getattr(self, name)
            if v is not None and not lo <= v <= hi:
                raise bad(name, f"{name}={v}: must be in [{lo}, {hi}] (the OpenAI API's range)")
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise bad("seed", f"seed={self.seed}: must be in 0 .. 2**64-1")
        controls = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
        given = {k: getattr(self, k) for k in controls if getattr(self, k) is not None}
        try:  # every other rule is SamplingParams' (config.py): its message names the field
            SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_tokens or max_seq_len, **given
            )
        except DFlashError as e:
            msg = str(e).replace("max_new_tokens", max_field)
            raise ApiError(400, msg, msg.split("=")[0]) from None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            **given,
            **({"bad_words": self.bad_words} if self.bad_words else {}),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
            "seed": self.seed,
            "stop_words": [s for s in stops if s] or None,
            "end_id": -1 if self.ignore_eos else None,
            **({"return_token_ids": True} if self.return_token_ids else {}),
        }


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def to_generation(self, max_seq_len: int) -> Generation:
        kw = self._common(self.max_tokens, "max_tokens", max_seq_len)
        if self.logprobs is not None:
            raise bad("logprobs", "not supported; leave it out")
        if self.best_of not in (None, 1):
            raise bad("best_of", f"best_of={self.best_of}: only 1 is supported")
        if self.suffix:
            raise bad("suffix", "not supported; leave it out")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise bad(
                    "prompt", "give one text prompt (a string, or a list of one string); token ids are not accepted"
                )
            prompt = prompt[0]
        if not prompt:
            raise bad("prompt", "empty prompt")
        kw["exclude_input_in_output"] = not self.echo
        return Generation(prompt, self.max_tokens or max_seq_len, bool(self.stream), self._usage_in_stream(), kw)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message's OpenAI fields (and vLLM's reasoning_content); the chat template reads them. Any other
    field is refused (400 naming messages[i].field), as at the top level: nothing is silently dropped."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    refusal: str | None = None
    reasoning_content: str | None = None

    def as_template_dict(self) -> dict:
        """The message as a chat template sees it: content parts joined into one string."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")
        return d


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None

    def to_generation(self, max_seq_len: int) -> Generation:
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise bad("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
        field_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kw = self._common(max_tokens, field_name, max_seq_len)
        if self.logprobs or self.top_logprobs:
            raise bad("logprobs", "not supported; leave it out")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise bad(name, "tool calling is not supported; leave it out")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise bad("tool_choice", "tool calling is not supported; leave it out")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad("response_format", "only {'type': 'text'} is supported")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise bad(f"messages[{i}].role", f"role {m.role!r}: must be one of {', '.join(ROLES)}")
        # the prompt is rendered by the caller (needs the tokenizer); the engine stops at the context end
        return Generation("", max_tokens or max_seq_len, bool(self.stream), self._usage_in_stream(), kw)

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages]


@dataclass
class Generation:
    """What one API request asks the text front door for (build_inputs' arguments)."""

    prompt: str
    max_tokens: int
    stream: bool
    usage_in_stream: bool
    inputs: dict = field(default_factory=dict)


# ---- responses ---------------------------------------------------------------------------------


def usage(res: dict) -> dict:
    p, c = int(res.get("num_input_tokens") or 0), int(res.get("num_output_tokens") or 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def dflash_stats(res: dict) -> dict:
    """The response's extra field: acceptance statistics of this request (serving/protocol.py)."""
    return {
        "acceptance_length": res.get("acceptance_length"),
        "acceptance_rate": res.get("acceptance_rate"),
        "accepted_draft_tokens": res.get("total_accepted_draft_tokens"),
        "draft_tokens": res.get("total_draft_tokens"),
    }


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _envelope(rid: str, model: str, obj: str, choices: list, created: int | None = None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model, "choices": choices}


def completion_body(rid: str, model: str, chat: bool, res: dict) -> dict:
    """The whole (non-streamed) response from the front door's one result."""
    finish = res.get("finish_reason") or None
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": res["text"]},
            "logprobs": None,
            "finish_reason": finish,
        }
        body = _envelope(rid, model, "chat.completion", [choice])
    else:
        choice = {"index": 0, "text": res["text"], "logprobs": None, "finish_reason": finish}
        body = _envelope(rid, model, "text_completion", [choice])
    if "output_ids" in res:  # return_token_ids; vLLM puts a chat's prompt ids at the top, SGLang in the choice
        choice.update(prompt_token_ids=res["prompt_ids"], token_ids=res["output_ids"])
        if chat:
            body["prompt_token_ids"] = res["prompt_ids"]
    return {**body, "usage": usage(res), "dflash": dflash_stats(res)}


def chunk_body(rid: str, model: str, chat: bool, created: int, text: str | None, res: dict | None, role: bool = False):
    """One streamed chunk: `text` as the delta; res (the final front-door response) adds the
    finish reason and the dflash statistics; role=True is chat's opening delta."""
    finish = None
    if res is not None:
        finish = res.get("finish_reason") or None
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = _envelope(rid, model, "chat.completion.chunk", [choice], created)
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = _envelope(rid, model, "text_completion", [choice], created)
    if res is not None:
        body["dflash"] = dflash_stats(res)
    return body


def usage_chunk(rid: str, model: str, chat: bool, created: int, res: dict) -> dict:
    """stream_options.include_usage: the last chunk, no choices, the usage (and dflash statistics)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(rid, model, obj, [], created), "usage": usage(res), "dflash": dflash_stats(res)}


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "dflash-trt"}]}
