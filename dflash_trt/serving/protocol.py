"""Request parsing, validation and response tensors of the serving models (no Triton imports).

Boundary: the tensor-level contract of the model repository. Every model has
`max_batch_size > 0` (tensorrtllm_backend convention), so each tensor carries a leading batch
dimension: a client sends `text_input` as [B, 1] (B = 1 for the ensemble and the engine model,
which advertise max_batch_size 1), `input_ids` as [1, L]. Getters passed in here return the
numpy array of an input or None.

Text front doors (`ensemble`, `dflash_bls`, `dflash_unary`) take TEXT_INPUTS; the engine model
`dflash` takes TOKEN_INPUTS (ids instead of text, stop words as flattened token sequences, plus
`request_key` / `cancel_key` so a front door can cancel what it started). `dflash_unary` and
`dflash_bls` also serve requests of several rows (`batch_rows`): each row is its own generation.
Stop words are text for every model (serving/stops.py). Every bad field raises
RequestError naming the field; the caller turns it into an error response for that request only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dflash_trt.config import SamplingParams
from dflash_trt.decoding import stats as decode_stats
from dflash_trt.errors import DFlashError
from dflash_trt.serving.text import split_stop_sequences
from dflash_trt.serving.trtllm_inputs import TRTLLM_INPUTS, logit_controls

Getter = Callable[[str], np.ndarray | None]

# name -> (Triton type, required) for the text front doors; the ensemble's config lists the same.
TEXT_INPUTS = {
    "text_input": ("TYPE_STRING", True),
    "max_tokens": ("TYPE_INT32", True),
    "stream": ("TYPE_BOOL", False),
    "temperature": ("TYPE_FP32", False),
    "top_k": ("TYPE_INT32", False),
    "top_p": ("TYPE_FP32", False),
    "seed": ("TYPE_UINT64", False),
    "stop_words": ("TYPE_STRING", False),
    "end_id": ("TYPE_INT32", False),
    "exclude_input_in_output": ("TYPE_BOOL", False),
    "return_perf_metrics": ("TYPE_BOOL", False),
    "apply_chat_template": ("TYPE_BOOL", False),
    **{k: (t, False) for k, t in TRTLLM_INPUTS.items()},  # tensorrtllm_backend's extra inputs
}
# what the BLS front doors (`dflash_bls`, `dflash_unary`) take beyond TEXT_INPUTS: the final response's
# output_ids, which a Triton ensemble cannot route (its outputs are fixed by the ensemble's steps)
DIRECT_TEXT_INPUTS = {**TEXT_INPUTS, "return_token_ids": ("TYPE_BOOL", False)}
# the acceptance statistics every text front door returns (acceptance_* FP32, the counts integers)
STAT_OUTPUTS = (
    "acceptance_rate",
    "acceptance_length",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "num_input_tokens",
    "num_output_tokens",
)
# outputs of every text front door (one response per step when streaming, else one in all)
TEXT_OUTPUTS = ("text_output", "finish_reason", *STAT_OUTPUTS, "perf_metrics")


class RequestError(DFlashError):
    """A request field is missing or out of range; the message starts with the field name."""


def _one(get: Getter, name: str):
    a = get(name)
    if a is None:
        return None
    a = np.asarray(a)
    if a.size != 1:
        raise RequestError(f"{name}: expected one value per request (shape [1, 1]), got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _str(v, name: str) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name}: not valid UTF-8") from None
    return str(v)


def _strings(get: Getter, name: str) -> list[str]:
    a = get(name)
    if a is None:
        return []
    return [_str(v, name) for v in np.asarray(a).reshape(-1)]


def _int(get: Getter, name: str, default):
    v = _one(get, name)
    return default if v is None else int(v)


def _float(get: Getter, name: str, default):
    v = _one(get, name)
    return default if v is None else float(v)


def _bool(get: Getter, name: str, default):
    v = _one(get, name)
    return default if v is None else bool(v)


def batch_rows(get: Getter, first: str) -> list[Getter]:
    """A request whose inputs carry B rows (batch dimension B, as `first` shows) as B getters of
    one row each; Triton has checked that every input has the same batch dimension."""
    a = get(first)
    n = np.asarray(a).shape[0] if a is not None and np.asarray(a).ndim else 1
    if n <= 1:
        return [get]
    cache: dict[str, np.ndarray | None] = {}

    def row(i: int) -> Getter:
        def g(name: str):
            if name not in cache:
                cache[name] = get(name)
            v = cache[name]
            return v[i : i + 1] if v is not None and np.asarray(v).ndim and len(v) == n else v

        return g

    return [row(i) for i in range(n)]


def parse_stop_words(get: Getter) -> list[str]:
    """stop_words: STRING [1, K]; empty strings pad a batch whose rows have fewer words."""
    return [w for w in _strings(get, "stop_words") if w]


def parse_bad_words(get: Getter) -> list[str]:
    """bad_words: STRING [1, K], tensorrtllm_backend's text form (the front doors make them token ids)."""
    return [w for w in _strings(get, "bad_words") if w]


class Sampling:
    """A request's sampling: SamplingParams (config.py, the one home of the sampling rules; it validates
    them and its messages name the field) plus what only the transport knows: stream, end_id (replaces
    the model's EOS; -1 = never stop on EOS), return_perf_metrics. `params` keywords are SamplingParams
    fields (temperature, top_k, top_p, seed, the logit controls); max_tokens is its max_new_tokens."""

    def __init__(
        self, max_tokens: int, stream: bool = False, end_id: int | None = None, return_perf_metrics=False, **params
    ):
        if end_id is not None and end_id < -1:
            raise RequestError(f"end_id={end_id}: must be a token id, or -1 to ignore EOS")
        try:
            self.params = SamplingParams(max_new_tokens=max_tokens, **params)
        except DFlashError as e:  # the request's field is max_tokens
            raise RequestError(str(e).replace("max_new_tokens", "max_tokens")) from None
        self.stream, self.end_id, self.return_perf_metrics = bool(stream), end_id, bool(return_perf_metrics)

    @property
    def max_tokens(self) -> int:
        return self.params.max_new_tokens

    def to_params(self, stop_token_ids=()) -> SamplingParams:
        stops = tuple(stop_token_ids)
        if self.end_id is not None and self.end_id >= 0:
            stops += (self.end_id,)
        return replace(self.params, stop_token_ids=stops, ignore_eos=self.end_id is not None)


def parse_sampling(get: Getter) -> Sampling:
    max_tokens = _int(get, "max_tokens", None)
    if max_tokens is None:
        raise RequestError("max_tokens: required input missing (how many tokens to generate)")
    kw = logit_controls(get, _one, RequestError)
    ids = get("bad_words_ids")  # the engine model's form; text models send `bad_words` (strings)
    if ids is not None:
        kw["bad_words_ids"] = tuple(tuple(w) for w in split_stop_sequences(np.asarray(ids).reshape(-1)))
    return Sampling(
        max_tokens,
        stream=_bool(get, "stream", False),
        end_id=_int(get, "end_id", None),
        return_perf_metrics=_bool(get, "return_perf_metrics", False),
        temperature=_float(get, "temperature", 0.0),
        top_k=_int(get, "top_k", 0),
        top_p=_float(get, "top_p", 1.0),
        seed=_int(get, "seed", None),
        **kw,
    )


@dataclass
class TextRequest:
    text: str
    sampling: Sampling
    stop_words: list[str] = field(default_factory=list)
    exclude_input_in_output: bool = True
    apply_chat_template: bool | None = None  # None: the model's default
    bad_words: list[str] = field(default_factory=list)  # text; the front door makes them token ids
    # dflash_bls / dflash_unary only: the final response also carries the generated ids (`output_ids`),
    # for clients that need the exact tokens (the OpenAI API's return_token_ids, `data generate --server`)
    return_token_ids: bool = False


def parse_prompt(get: Getter) -> tuple[str, list[str], bool | None]:
    """text_input, stop_words, apply_chat_template (what the preprocessing model needs)."""
    v = _one(get, "text_input")
    if v is None:
        raise RequestError("text_input: required input missing (the prompt, STRING shape [1, 1])")
    text = _str(v, "text_input")
    if not text:
        raise RequestError("text_input: empty prompt")
    return text, parse_stop_words(get), _bool(get, "apply_chat_template", None)


def parse_text_request(get: Getter) -> TextRequest:
    text, stop_words, chat = parse_prompt(get)
    s = parse_sampling(get)
    return TextRequest(
        text,
        s,
        stop_words,
        _bool(get, "exclude_input_in_output", True),
        chat,
        parse_bad_words(get),
        _bool(get, "return_token_ids", False),
    )


@dataclass
class TokenRequest:
    prompt_ids: list[int]
    sampling: Sampling
    stop_sequences: list[list[int]] = field(default_factory=list)
    request_key: str | None = None
    exclude_input_in_output: bool = True  # False: output_ids start with the prompt ids (TensorRT-LLM style)
    stop_words: list[str] = field(default_factory=list)  # text stop strings (serving/stops.py)
    # the engine model's matcher of stop_words: (output ids, ids checked before) -> ids to keep, or None
    text_stop: Callable[[list[int], int], int | None] | None = None


@dataclass
class CancelRequest:
    key: str


def parse_token_request(get: Getter) -> TokenRequest | CancelRequest:
    cancel = _one(get, "cancel_key")
    if cancel is not None:
        return CancelRequest(_str(cancel, "cancel_key"))
    ids = get("input_ids")
    if ids is None:
        raise RequestError("input_ids: required input missing (prompt token ids, INT32 shape [1, L])")
    ids = np.asarray(ids)
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise RequestError(f"input_ids: one prompt per request (shape [1, L]), got shape {list(ids.shape)}")
    prompt = [int(t) for t in ids.reshape(-1)]
    if not prompt:
        raise RequestError("input_ids: empty prompt")
    stops = get("stop_sequences")
    key = _one(get, "request_key")
    stop_sequences = split_stop_sequences(stops.reshape(-1)) if stops is not None else []
    return TokenRequest(
        prompt,
        parse_sampling(get),
        stop_sequences,
        _str(key, "request_key") if key is not None else None,
        _bool(get, "exclude_input_in_output", True),
        parse_stop_words(get),
    )


# ---- responses -------------------------------------------------------------------------------
@dataclass
class Progress:
    """What the engine model reports for a request: all ids so far and the running statistics."""

    output_ids: list[int]
    num_prev: int  # ids earlier responses already carried
    finish_reason: str  # "" while running; "stop" | "length" | "cancelled"
    num_input_tokens: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_verify_steps: int
    perf: dict | None = None

    @property
    def acceptance_rate(self) -> float:
        return decode_stats.acceptance_rate(self.num_accepted_draft_tokens, self.num_draft_tokens)

    @property
    def acceptance_length(self) -> float:
        """tau, as decoding/stats.py defines it."""
        return decode_stats.tau(self.num_accepted_draft_tokens, self.num_verify_steps)


def token_outputs(p: Progress, prefix_ids=(), stop_words=()) -> dict[str, np.ndarray]:
    """Tensors of one engine response; prefix_ids (the prompt) lead output_ids when given, and
    num_prev_tokens then counts them too (after the first response). `stop_words` and
    `num_echoed_tokens` repeat what the ensemble's postprocessing needs to cut the text: Triton
    refuses an ensemble step that mixes ensemble inputs with a decoupled step's outputs."""
    prefix = list(prefix_ids)
    return {
        "stop_words": np.array([[w.encode() for w in stop_words] or [b""]], dtype=object),
        "num_echoed_tokens": np.array([[len(prefix)]], dtype=np.int32),
        "output_ids": np.array([prefix + p.output_ids], dtype=np.int32).reshape(1, -1),
        "num_prev_tokens": np.array([[p.num_prev + len(prefix) if p.num_prev else 0]], dtype=np.int32),
        "num_verify_steps": np.array([[p.num_verify_steps]], dtype=np.int32),
        **_summary_outputs(p),
    }


def _summary_outputs(p: Progress) -> dict[str, np.ndarray]:
    """finish_reason, STAT_OUTPUTS and perf_metrics: what both an engine response and a text response carry
    (a text response builds only these, not the whole output_ids array, on every streamed chunk)."""
    return {
        "finish_reason": np.array([[p.finish_reason.encode()]], dtype=object),
        "num_input_tokens": np.array([[p.num_input_tokens]], dtype=np.int32),
        "num_output_tokens": np.array([[len(p.output_ids)]], dtype=np.int32),
        "total_draft_tokens": np.array([[p.num_draft_tokens]], dtype=np.int32),
        "total_accepted_draft_tokens": np.array([[p.num_accepted_draft_tokens]], dtype=np.int32),
        "acceptance_rate": np.array([[p.acceptance_rate]], dtype=np.float32),
        "acceptance_length": np.array([[p.acceptance_length]], dtype=np.float32),
        "perf_metrics": np.array([[json.dumps(p.perf).encode() if p.perf else b""]], dtype=object),
    }


def progress_from(get: Getter) -> Progress:
    """Inverse of token_outputs (front doors read the engine model's responses with it)."""
    perf = _str(_one(get, "perf_metrics") or b"", "perf_metrics")
    return Progress(
        output_ids=[int(t) for t in np.asarray(get("output_ids")).reshape(-1)],
        num_prev=_int(get, "num_prev_tokens", 0),
        finish_reason=_str(_one(get, "finish_reason"), "finish_reason"),
        num_input_tokens=_int(get, "num_input_tokens", 0),
        num_draft_tokens=_int(get, "total_draft_tokens", 0),
        num_accepted_draft_tokens=_int(get, "total_accepted_draft_tokens", 0),
        num_verify_steps=_int(get, "num_verify_steps", 0),
        perf=json.loads(perf) if perf else None,
    )


def text_outputs(text: str, p: Progress, token_ids: bool = False) -> dict[str, np.ndarray]:
    """TEXT_OUTPUTS; token_ids: plus `output_ids`, the generated ids so far (a final response's only)."""
    out = {"text_output": np.array([[text.encode("utf-8")]], dtype=object), **_summary_outputs(p)}
    if token_ids:
        out["output_ids"] = np.array([p.output_ids], dtype=np.int32).reshape(1, -1)
    return out
