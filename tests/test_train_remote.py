"""`data generate --server` (train/remote.py): a tiny fake OpenAI server (stdlib http.server on
127.0.0.1) for concurrency, retries, refusals and kill-and-resume; and end to end against a real
`dflash-trt serve --openai-port` (test_openai_api.py's server fixture): the shards equal
in-process greedy generate_data's byte for byte, chat and raw prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.train.data import read_sequences
from dflash_trt.train.remote import Regenerator, ServerConfig, generate_remote

PROMPTS = [f"prompt number {i}" for i in range(10)]


def answer_ids(prompt: str) -> tuple[list[int], list[int]]:
    """The fake model: prompt ids from the characters, an answer from the length (ends with stop id 2)."""
    return [ord(c) % 50 + 3 for c in prompt], [len(prompt) % 7 + 10, len(prompt) % 5 + 20, 2]


class Fake:
    """A fake OpenAI server. faults[prompt] = list of (status, headers) answered before success;
    hold: prompts whose request blocks until `release` is set; wait_for: the handler waits (an
    event, with a deadline) until this many requests are in flight, to observe the concurrency."""

    def __init__(self, faults=None, hold=(), wait_for=0, token_ids=True, models=("m",)):
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.hold, self.wait_for, self.token_ids, self.models = set(hold), wait_for, token_ids, models
        self.release, self.lock, self.full = threading.Event(), threading.Lock(), threading.Event()
        self.seen: list[str] = []
        self.in_flight = self.max_in_flight = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": m} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
                self.reply(*fake.answer(self.path, body, prompt))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path, body, prompt):
        with self.lock:
            self.seen.append(prompt)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.in_flight >= self.wait_for:
                self.full.set()
            fault = self.faults.get(prompt, []).pop(0) if self.faults.get(prompt) else None
        try:
            if self.wait_for:
                self.full.wait(10)  # until `wait_for` requests overlap (or the deadline)
            if prompt in self.hold:
                self.release.wait(60)
            if fault:
                return fault[0], {"error": {"message": f"injected {fault[0]}"}}, fault[1]
            assert body["return_token_ids"] is True and body["temperature"] == 0.0
            p, a = answer_ids(prompt)
            choice = {"index": 0, "finish_reason": "stop"}
            choice.update({"message": {"role": "assistant", "content": "x"}} if "chat" in path else {"text": "x"})
            if self.token_ids:
                choice.update(prompt_token_ids=p, token_ids=a)
            return 200, {"choices": [choice]}, ()
        finally:
            with self.lock:
                self.in_flight -= 1

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake(request):
    servers = []

    def make(**kw):
        servers.append(Fake(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def expected_lines(prompts):
    return [json.dumps({"input_ids": p + a, "prompt_len": len(p)}) for p, a in map(answer_ids, prompts)]


def shard_texts(folder):
    return {f.name: f.read_text() for f in sorted(folder.glob("data-*"))}


def cfg(url, **kw):
    return ServerConfig(url, **{"backoff": 0.001, "timeout": 30, **kw})


def test_concurrent_requests_land_in_prompt_order(fake, tmp_path):
    srv = fake(wait_for=4)
    out = generate_remote(Regenerator(cfg(srv.url, concurrency=4)), PROMPTS, tmp_path / "d", shard_size=4)
    assert srv.max_in_flight == 4  # four in flight, never more
    assert list(shard_texts(out)) == ["data-00000.jsonl", "data-00001.jsonl", "data-00002.jsonl"]
    lines = [ln for t in shard_texts(out).values() for ln in t.splitlines()]
    assert lines == expected_lines(PROMPTS)
    assert [s["prompt_len"] for s in read_sequences(out)] == [len(answer_ids(p)[0]) for p in PROMPTS]


def test_chat_and_raw_prompts_use_their_endpoints(fake, tmp_path):
    srv = fake()
    regen = Regenerator(cfg(srv.url, chat=False))
    assert "prompt" in regen.request("hi", 0) and "messages" in Regenerator(cfg(srv.url)).request("hi", 0)
    generate_remote(regen, PROMPTS[:2], tmp_path / "d")
    assert (tmp_path / "d" / "data-00000.jsonl").read_text().splitlines() == expected_lines(PROMPTS[:2])


def test_transient_errors_are_retried_then_succeed(fake, tmp_path):
    faults = {PROMPTS[1]: [(503, ()), (500, ())], PROMPTS[3]: [(429, [("Retry-After", "0")])]}
    srv = fake(faults=faults)
    out = generate_remote(Regenerator(cfg(srv.url, retries=2)), PROMPTS[:5], tmp_path / "d")
    assert srv.seen.count(PROMPTS[1]) == 3 and srv.seen.count(PROMPTS[3]) == 2 and len(srv.seen) == 8
    assert (out / "data-00000.jsonl").read_text().splitlines() == expected_lines(PROMPTS[:5])


def test_retries_are_bounded_and_finished_shards_kept(fake, tmp_path):
    srv = fake(faults={PROMPTS[5]: [(503, ())] * 10})
    with pytest.raises(DFlashError, match=r"HTTP 503.*after 2 retries.*run the command again"):
        generate_remote(Regenerator(cfg(srv.url, retries=2, concurrency=1)), PROMPTS, tmp_path / "d", shard_size=4)
    assert srv.seen.count(PROMPTS[5]) == 3  # one try and two retries
    assert list(shard_texts(tmp_path / "d")) == ["data-00000.jsonl"]  # shard 1 (prompts 4-7) not half-written


def test_client_errors_fail_at_once_with_the_servers_message(fake, tmp_path):
    srv = fake(faults={PROMPTS[0]: [(400, ())]})
    with pytest.raises(DFlashError, match="HTTP 400: injected 400"):
        generate_remote(Regenerator(cfg(srv.url)), PROMPTS[:1], tmp_path / "d")
    assert srv.seen == [PROMPTS[0]]


def test_server_without_token_ids_is_refused_unless_retokenize(fake, tmp_path):
    srv = fake(token_ids=False)
    with pytest.raises(DFlashError, match="no prompt_token_ids / token_ids.*--retokenize"):
        generate_remote(Regenerator(cfg(srv.url)), PROMPTS[:1], tmp_path / "d")

    class Tok:  # what --retokenize uses of a tokenizer
        eos_token_id = 2

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}

    generate_remote(Regenerator(cfg(srv.url, chat=False, retokenize=True), Tok()), ["ab"], tmp_path / "r")
    assert json.loads((tmp_path / "r" / "data-00000.jsonl").read_text()) == {
        "input_ids": [1, 97, 98, ord("x"), 2],
        "prompt_len": 3,
    }


def test_model_name_comes_from_the_server_or_the_flag(fake):
    assert Regenerator(cfg(fake().url)).model == "m"
    two = fake(models=("a", "b"))
    with pytest.raises(DFlashError, match=r"serves \['a', 'b'\]: name one with --server-model"):
        Regenerator(cfg(two.url))
    assert Regenerator(cfg(two.url, model="b")).model == "b"


def test_bad_urls_and_unreachable_servers_are_one_line(tmp_path):
    with pytest.raises(DFlashError, match="give an http"):
        ServerConfig("localhost:8000")
    assert ServerConfig("http://h:1/").url == "http://h:1/v1" == ServerConfig("http://h:1/v1").url
    with pytest.raises(DFlashError, match="ConnectionRefused|URLError.*after 1 retries"):
        Regenerator(cfg("http://127.0.0.1:9", retries=1))


def test_killed_run_resumes_after_its_finished_shards(fake, tmp_path):
    """A run killed (SIGKILL) while shard 2 is in flight leaves shards 0 and 1 whole and nothing
    else; the next run sends only the prompts of shard 2 on, and the folder equals a one-shot run's."""
    srv = fake(hold={PROMPTS[7]})
    out = tmp_path / "d"
    code = (
        "import sys; from dflash_trt.train.remote import *; "
        "generate_remote(Regenerator(ServerConfig(sys.argv[1], concurrency=2)), "
        f"{PROMPTS!r}, sys.argv[2], shard_size=3, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, srv.url, str(out)])
    try:
        deadline = time.monotonic() + 120
        while not (out / "data-00001.jsonl").is_file() or PROMPTS[7] not in srv.seen:
            assert proc.poll() is None and time.monotonic() < deadline, "shards 0-1 never written"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("data-")) == [
        "data-00000.jsonl",
        "data-00001.jsonl",
    ]
    srv.hold.clear()
    srv.release.set()
    before = len(srv.seen)
    generate_remote(Regenerator(cfg(srv.url, concurrency=2)), PROMPTS, out, shard_size=3, progress=False)
    again = set(srv.seen[before:])  # (a request the killed run had sent may be recorded late: prompts 6-9 only)
    assert again >= set(PROMPTS[6:]) and not again & set(PROMPTS[:6])  # shards 0 and 1 were not redone
    one_shot = generate_remote(Regenerator(cfg(srv.url)), PROMPTS, tmp_path / "once", shard_size=3, progress=False)
    assert shard_texts(out) == shard_texts(one_shot)


# ---- end to end: a real `dflash-trt serve --openai-port` ----------------------------------------
try:  # its server fixture (nvidia-pytriton's tritonserver, the tiny random Qwen3 pair with ChatML)
    from test_openai_api import API_KEY, api, models  # noqa: F401
except pytest.skip.Exception as e:
    _skip = str(e)

    @pytest.fixture
    def api():
        pytest.skip(_skip)

    models = API_KEY = None


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("chat", [True, False])
def test_served_answers_equal_in_process_greedy_generation(models, api, tmp_path, chat):
    from dflash_trt.api import load_tokenizer
    from dflash_trt.train.data import generate_data

    root, target, _ = models
    prompts = ["hello world", "def add(a, b):", "héllo wörld ✓ 漢字", "The quick brown fox", "a", "Speculative"]
    tok = load_tokenizer(root / "target")
    mine = generate_data(target, tok, prompts, tmp_path / "local", 20, 2, chat, shard_size=4, progress=False)
    # the server requires its key (test_openai_api's fixture: serve with $DFLASH_TRT_API_KEY)
    cfg = ServerConfig(str(api.client.base_url), chat=chat, max_new_tokens=20, concurrency=4, api_key=API_KEY)
    regen = Regenerator(cfg, tok)
    assert regen.model == "tiny"
    served = generate_remote(regen, prompts, tmp_path / "served", shard_size=4, progress=False)
    assert shard_texts(served) == shard_texts(mine) and len(shard_texts(mine)) == 2


def test_openai_schema_return_token_ids():
    """dflash-trt serve's side (serving/openai_schema.py): the field reaches the front door, is
    refused when streamed, and the response carries the ids where vLLM and SGLang put them."""
    from dflash_trt.serving.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, completion_body

    msgs = [{"role": "user", "content": "hi"}]
    assert (
        ChatCompletionRequest(model="m", messages=msgs, return_token_ids=True)
        .to_generation(64)
        .inputs["return_token_ids"]
    )
    assert "return_token_ids" not in CompletionRequest(model="m", prompt="hi").to_generation(64).inputs
    with pytest.raises(ApiError, match="return_token_ids: only with stream=false"):
        CompletionRequest(model="m", prompt="hi", return_token_ids=True, stream=True).to_generation(64)
    res = {"text": "x", "finish_reason": "stop", "output_ids": [7, 2], "prompt_ids": [1, 5]}
    chat = completion_body("id", "m", True, res)
    assert chat["prompt_token_ids"] == chat["choices"][0]["prompt_token_ids"] == [1, 5]
    assert chat["choices"][0]["token_ids"] == [7, 2]
    plain = completion_body("id", "m", False, res)
    assert plain["choices"][0]["token_ids"] == [7, 2] and "prompt_token_ids" not in plain
    assert "token_ids" not in completion_body("id", "m", False, {"text": "x", "finish_reason": "stop"})["choices"][0]
