"""`dflash-trt data generate --server URL`: the target's answers from any OpenAI-compatible server.

Boundary: prompts in, the same data-*.jsonl shards as data.generate_data out (one
{"input_ids", "prompt_len"} line per prompt, in prompt order, written atomically per shard and
resumed the same way); HTTP to the server only (stdlib urllib, no new dependency). The server is
vLLM, SGLang, TensorRT-LLM's trtllm-serve or `dflash-trt serve --openai-port`, serving the target.

Which endpoint, and why the ids equal in-process generation's. With --chat each prompt goes to
/v1/chat/completions as one user message, so the server applies the chat template it serves with
(a `--chat-template` override included): the drafter then learns the prompts it will be verified on.
Every request asks for `return_token_ids` (vLLM >= 0.10.2, SGLang, dflash-trt serve), and the line
holds the server's own prompt_token_ids + token_ids, never a re-tokenisation of text: generated
ids need not be the canonical tokenisation of their text (a random or small model's often are
not), and a text cut at max_tokens may end inside a UTF-8 character. For a greedy server running
the target in the precision of in-process generation, the lines therefore equal
generate_data's exactly (tests/test_train_remote.py checks it against `dflash-trt serve`).
A server that returns no ids is refused, unless --retokenize is given: then the prompt is encoded
with the local tokenizer (its template), the text re-encoded, and the EOS appended on a "stop"
finish; approximate, and said so.

Failures: connection errors, timeouts and HTTP 408/429/5xx are retried `retries` times with
exponential backoff (doubling from `backoff` seconds, capped at 60 s, or the server's Retry-After);
any other HTTP error fails at once with the server's message. A failed run keeps every finished
shard; running the same command again resumes after them.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dflash_trt.api import encode
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.train.data import shard_lines, write_shard

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_DELAY = 60.0


@dataclass
class ServerConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None  # the served model name; None: the only one /v1/models lists
    chat: bool = True  # /v1/chat/completions (the server's chat template) or /v1/completions (raw prompt)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # prompt i is sent seed + i (sampling only)
    concurrency: int = 8  # requests in flight
    retries: int = 5  # extra tries of a request that failed transiently
    backoff: float = 1.0  # seconds before the first retry; doubles each time
    timeout: float = 600.0  # seconds per HTTP request
    retokenize: bool = False  # accept a server without return_token_ids (approximate ids)
    api_key: str | None = field(default=None, repr=False)  # sent as 'Authorization: Bearer <key>'

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--server {self.url}: give an http(s) URL, e.g. http://127.0.0.1:8000/v1")
        self.url = self.url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        for name in ("max_new_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.retries < 0 or self.backoff < 0 or self.timeout <= 0:
            raise ConfigError("retries, backoff: must be >= 0; timeout: must be > 0")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _call(cfg: ServerConfig, method: str, path: str, body: dict | None = None) -> dict:
    """One HTTP exchange -> the JSON body; _Transient for what a retry may fix, DFlashError else."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:  # vLLM / SGLang / dflash-trt serve --api-key
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    req = urllib.request.Request(cfg.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=cfg.timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        if e.code in RETRY_STATUS:
            after = e.headers.get("Retry-After") if e.headers else None
            raise _Transient(f"HTTP {e.code}: {text}", float(after) if after and after.isdigit() else None) from None
        raise DFlashError(f"--server {cfg.url}{path}: HTTP {e.code}: {text}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise _Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
    except json.JSONDecodeError:
        raise _Transient("the response is not JSON") from None


def call_with_retries(cfg: ServerConfig, method: str, path: str, body: dict | None = None, sleep=time.sleep) -> dict:
    for attempt in range(cfg.retries + 1):
        try:
            return _call(cfg, method, path, body)
        except _Transient as e:
            if attempt == cfg.retries:
                raise DFlashError(
                    f"--server {cfg.url}{path}: {e} (after {cfg.retries} retries); finished shards are kept: "
                    f"run the command again to resume"
                ) from None
            delay = min(MAX_DELAY, cfg.backoff * 2**attempt) * (0.5 + 0.5 * random.random())
            sleep(max(delay, min(e.retry_after or 0.0, MAX_DELAY)))
    raise AssertionError("unreachable")


def served_model(cfg: ServerConfig) -> str:
    """cfg.model, else the one model the server lists (several: refused, name one with --server-model)."""
    if cfg.model:
        return cfg.model
    ids = [m["id"] for m in call_with_retries(cfg, "GET", "/models").get("data", [])]
    if len(ids) != 1:
        raise DFlashError(f"--server {cfg.url} serves {ids or 'no models'}: name one with --server-model")
    return ids[0]


class Regenerator:
    """One prompt -> its data line, through the server (thread-safe: one urllib request per call)."""

    def __init__(self, cfg: ServerConfig, tokenizer=None):
        self.cfg, self.tok = cfg, tokenizer
        if cfg.retokenize and tokenizer is None:
            raise ConfigError("--retokenize: needs the target's tokenizer (--target)")
        self.model = served_model(cfg)

    def request(self, prompt: str, index: int) -> dict:
        c = self.cfg
        body = {"model": self.model, "max_tokens": c.max_new_tokens, "temperature": c.temperature}
        body["return_token_ids"] = True
        if c.temperature > 0:
            body["seed"] = c.seed + index
        if c.chat:
            return {**body, "messages": [{"role": "user", "content": prompt}]}
        return {**body, "prompt": prompt}

    def __call__(self, prompt: str, index: int) -> str:
        path = "/chat/completions" if self.cfg.chat else "/completions"
        res = call_with_retries(self.cfg, "POST", path, self.request(prompt, index))
        try:
            choice = res["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise DFlashError(f"--server {self.cfg.url}{path}: a response without choices: {str(res)[:200]}") from None
        prompt_ids = choice.get("prompt_token_ids") or res.get("prompt_token_ids")  # SGLang / vLLM chat
        ids = choice.get("token_ids")
        if prompt_ids is None or ids is None:
            if not self.cfg.retokenize:
                raise DFlashError(
                    f"--server {self.cfg.url}: the response has no prompt_token_ids / token_ids (the "
                    f"return_token_ids extension of vLLM >= 0.10.2, SGLang and dflash-trt serve); use such a "
                    f"server, or add --retokenize to re-encode the text (approximate token ids)"
                )
            prompt_ids, ids = self._retokenized(prompt, choice)
        ids = [int(t) for t in ids]
        stop = choice.get("matched_stop", choice.get("stop_reason"))  # SGLang / vLLM: the stop id, if one
        if choice.get("finish_reason") == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
            ids.append(stop)  # a server that leaves the stop token out: training predicts it too
        if not ids:
            raise DFlashError(f"--server {self.cfg.url}: prompt {index} got an empty answer")
        prompt_ids = [int(t) for t in prompt_ids]
        return json.dumps({"input_ids": prompt_ids + ids, "prompt_len": len(prompt_ids)})

    def _retokenized(self, prompt: str, choice: dict) -> tuple[list[int], list[int]]:
        text = (choice.get("message") or {}).get("content") if self.cfg.chat else choice.get("text")
        ids = list(self.tok(text or "", add_special_tokens=False)["input_ids"])
        if choice.get("finish_reason") == "stop" and self.tok.eos_token_id is not None:
            ids.append(self.tok.eos_token_id)
        return encode(self.tok, prompt, self.cfg.chat), ids


def generate_remote(
    regen: Regenerator, prompts: list[str], out_dir: str | Path, shard_size: int = 256, progress: bool = True
) -> Path:
    """Every prompt answered by the server, regen.cfg.concurrency requests in flight, into
    out_dir/data-NNNNN.jsonl (data.generate_data's layout and resume rule: a finished shard is kept
    and its prompts are not sent again; a shard is written only whole, atomically)."""
    out, cfg = Path(out_dir), regen.cfg
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), desc=f"answers from {cfg.url}", disable=not progress)
    shards = []  # (index, lines already written, prompt indices still to answer)
    for i in range((len(prompts) + shard_size - 1) // shard_size):
        first, last = i * shard_size, min(len(prompts), (i + 1) * shard_size)
        lines = shard_lines(out, i)[: last - first]
        bar.update(len(lines))
        if first + len(lines) < last:
            shards.append((i, lines, range(first + len(lines), last)))
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        # all submitted at once, in prompt order: the pool keeps cfg.concurrency requests running across
        # shard boundaries (a shard's slowest answer does not idle the others); shards are written in order
        futures = {j: pool.submit(regen, prompts[j], j) for _, _, todo in shards for j in todo}
        try:
            for i, lines, todo in shards:
                for j in todo:
                    lines.append(futures[j].result())
                    bar.update(1)
                write_shard(out, i, lines)
        except BaseException:
            for f in futures.values():
                f.cancel()
            raise
    bar.close()
    return out
