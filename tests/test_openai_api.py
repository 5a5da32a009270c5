"""The OpenAI-compatible HTTP API (serving/openai_api.py): the official `openai` client
against a real `dflash-trt serve --openai-port` process (nvidia-pytriton's bundled tritonserver
on CPU, the tiny random Qwen3 pair with a real byte-level BPE tokenizer and a ChatML template),
one server for the module, compared with in-process greedy decoding; plus one small server whose
full queue refuses requests (HTTP 503)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
pytest.importorskip("fastapi", reason="fastapi not installed (pip install 'dflash-trt[serve]')")
openai = pytest.importorskip("openai", reason="openai not installed (pip install 'dflash-trt[test]')")

from conftest import processes_mentioning, tiny_pair_dir  # noqa: E402
from test_openai_schema import CHAT, template_ids  # noqa: E402
from test_serving import metrics, wait_cancelled  # noqa: E402

from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.decoding.loop import generate_baseline  # noqa: E402
from dflash_trt.serving.openai_schema import ChatCompletionRequest  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # one server start, ~15 s on 2 CPU cores
    pytest.mark.usefixtures("one_torch_thread"),  # conftest.py
]
MAX_SEQ = 256
API_KEY = "test-key-41"
PROMPTS = (  # sixteen prompts, as tests/test_serving.py sends
    "hello world|The quick brown fox|def add(a, b):|héllo wörld ✓ 漢字|Speculative decoding|a|"
    "return a + b|lazy dog jumps|ünïcode|The|quick quick quick|brown fox jumps over|verifies them.|"
    "漢字 漢字|drafts tokens|over the lazy dog and the quick brown fox"
).split("|")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    target = tiny_pair_dir(root, block_size=4)
    return root, target, TextCodec.from_dir(root / "target")


def api_repo(models, name: str, **values):
    """A model repository over the tiny pair holding what the API uses: dflash_bls and the engine
    (fewer backend processes than the whole repository: a faster start on 2 cores); with
    decoupled=False, what `dflash-trt build` writes then: dflash_unary instead of dflash_bls."""
    from dflash_trt.serving.repo import default_template_dir, default_values, fill_model_repo

    root, _, _ = models
    values = dict(dtype="float32", max_seq_len=MAX_SEQ, unary_instance_count=1, cpu_threads=1, **values)
    repo = fill_model_repo(
        default_template_dir(), root / name, default_values(root / "target", root / "drafter", **values)
    )
    door = "dflash_bls" if values.get("decoupled", True) else "dflash_unary"
    for unused in {"ensemble", "preprocessing", "postprocessing", "dflash_unary", "dflash_bls"} - {door}:
        shutil.rmtree(repo / unused)
    return repo


@pytest.fixture(scope="module")
def api(models):
    from dflash_trt.serving.server import free_port

    # the repository's default is the chat template: /v1/completions must still send raw prompts
    repo = api_repo(models, "repo", max_batch=8)
    ports = [free_port() for _ in range(4)]
    cmd = [sys.executable, "-c", "import sys; from dflash_trt.cli import main; sys.exit(main())", "serve"]
    cmd += ["--model-repo", str(repo), "--grpc-port", str(ports[0]), "--http-port", str(ports[1])]
    cmd += ["--metrics-port", str(ports[2]), "--openai-port", str(ports[3]), "--served-model-name", "tiny"]
    # bound to all interfaces (reached here through loopback only), the API with a key from the environment
    cmd += ["--openai-host", "0.0.0.0"] + [f"--{e}-address=0.0.0.0" for e in ("grpc", "http", "metrics")]
    env = dict(os.environ, DFLASH_TRT_API_KEY=API_KEY)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()

    def read():
        for ln in proc.stdout:
            lines.put(ln)
        lines.put(None)  # exited

    threading.Thread(target=read, daemon=True).start()
    try:
        seen = [""]
        while not seen[-1].startswith("ready:"):
            try:
                seen.append(lines.get(timeout=300))
            except queue.Empty:
                seen.append(None)
            if seen[-1] is None:  # exited, or silent for 5 minutes
                pytest.fail(f"serve not ready: {''.join(seen[:-1])}")
        assert f"OpenAI http://127.0.0.1:{ports[3]}/v1" in seen[-1], seen[-1]
        assert f"(bound: gRPC 0.0.0.0:{ports[0]}" in seen[-1], seen[-1]
        base = f"http://127.0.0.1:{ports[3]}/v1"
        client = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=300)
        yield SimpleNamespace(client=client, metrics_url=f"http://127.0.0.1:{ports[2]}/metrics", base=base)
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        time.sleep(0.5)  # the reader thread's last lines
        assert code == 0, "".join(iter(lambda: lines.get_nowait() or "", "")) if not lines.empty() else code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not processes_mentioning(str(repo)), "backend stubs left running"


def expected(models, prompt, max_tokens: int) -> tuple[str, int, int]:
    """In-process greedy text, output and prompt token counts; prompt: text, or chat messages."""
    root, target, codec = models
    if isinstance(prompt, str):
        ids = codec.encode(prompt, chat=False)
    else:  # what `dflash-trt generate --chat` runs on: transformers' apply_chat_template ids
        from transformers import AutoTokenizer

        msgs = ChatCompletionRequest(model="m", messages=prompt).template_messages()
        ids = template_ids(AutoTokenizer.from_pretrained(root / "target"), msgs)
    toks = generate_baseline(target, [ids], SamplingParams(max_new_tokens=max_tokens)).tokens[0]
    return codec.decode(toks), len(toks), len(ids)


def _stream_text(stream, chat: bool = False) -> tuple[str, list]:
    chunks = list(stream)
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    return "".join(pieces), chunks


def test_models_lists_the_served_name(api):
    assert [m.id for m in api.client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        api.client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["type"] == "invalid_request_error"


def test_a_wrong_or_missing_api_key_is_refused_with_401_streamed_and_unary(api):
    """serve bound to 0.0.0.0 with $DFLASH_TRT_API_KEY: the key is required on /v1 (the module's other
    tests send it), refused in OpenAI's error shape; /health stays open."""
    for key in ("test-key-4", API_KEY + "x"):
        client = openai.OpenAI(base_url=api.base, api_key=key, max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.AuthenticationError) as e:
                client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=stream)
            assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "invalid_request_error"
    for stream in (False, True):  # no Authorization header at all
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
        req = urllib.request.Request(api.base + "/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(api.base.replace("/v1", "/health"), timeout=60) as r:
        assert json.loads(r.read()) == {"ready": True}


def test_sixteen_concurrent_greedy_requests_equal_in_process(models, api):
    want = {i: expected(models, p, 8 + 3 * i) for i, p in enumerate(PROMPTS)}

    def run(i):
        kw = dict(model="tiny", prompt=PROMPTS[i], max_tokens=8 + 3 * i, temperature=0)
        if i % 2:
            return _stream_text(api.client.completions.create(stream=True, **kw))[0], None
        r = api.client.completions.create(**kw)
        return r.choices[0].text, r

    with ThreadPoolExecutor(16) as pool:
        got = dict(zip(range(16), pool.map(run, range(16))))
    assert {i: text for i, (text, _) in got.items()} == {i: w[0] for i, w in want.items()}
    for i, (_, r) in got.items():
        if r is not None:  # usage counts are the token counts of in-process decoding
            u = r.usage
            assert (u.completion_tokens, u.prompt_tokens) == want[i][1:] and u.total_tokens == sum(want[i][1:])
            assert r.choices[0].finish_reason in ("length", "stop")
            stats = r.model_extra["dflash"]
            assert 0 <= stats["accepted_draft_tokens"] <= stats["draft_tokens"] and stats["acceptance_length"] >= 1


def test_streamed_chunks_join_to_the_unary_text_with_usage_last(models, api):
    kw = dict(model="tiny", prompt="héllo wörld ✓ 漢字", max_tokens=40, temperature=0)
    whole = api.client.completions.create(**kw)
    text, chunks = _stream_text(
        api.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert text == whole.choices[0].text and len(chunks) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["dflash"] == whole.model_extra["dflash"]


def test_chat_completion_equals_chat_templated_in_process(models, api):
    text, n_out, n_in = expected(models, CHAT, 24)
    r = api.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=24, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_in, n_out)
    s = api.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, stream=True)
    streamed, chunks = _stream_text(s, chat=True)
    assert streamed == text and chunks[0].choices[0].delta.role == "assistant"


def test_stop_strings_cut_the_text_before_them(models, api):
    """vLLM semantics: the text ends just before the first stop string, finish_reason 'stop'."""
    prompt = "over the lazy dog and the quick brown fox"
    full = expected(models, prompt, 48)[0]
    assert len(full) >= 12, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    want = full[: full.index(stop)]
    for stops in (stop, ["never-in-the-text", stop]):
        kw = dict(model="tiny", prompt=prompt, max_tokens=48, temperature=0, stop=stops)
        r = api.client.completions.create(**kw)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        assert _stream_text(api.client.completions.create(stream=True, **kw))[0] == want


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(n=2), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(extra_body={"frobnicate": 1}), "frobnicate"),
        (dict(prompt="x " * (MAX_SEQ + 10)), "prompt"),  # refused by the engine, behind Triton
        (dict(stream=True, prompt="x " * (MAX_SEQ + 10)), "prompt"),  # before any event is sent
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(api, kw, param):
    kw = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(**kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", e.value.body
    assert param in e.value.body["message"]


def test_bad_chat_requests_get_400_naming_the_field(api):
    for kw, param in [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            api.client.chat.completions.create(**{"model": "tiny", "messages": CHAT, "max_tokens": 4, **kw})
        assert e.value.body["param"] == param, e.value.body


def test_client_disconnect_frees_the_request(models, api):
    long = dict(model="tiny", prompt="over the lazy dog", max_tokens=MAX_SEQ - 20, temperature=0)
    long["extra_body"] = {"ignore_eos": True}  # vLLM's extension: the whole length, whatever the model says
    before = metrics(api).get("dflash_cancelled_requests_total", 0)
    stream = api.client.completions.create(stream=True, **long)
    it = iter(stream)
    first = [next(it), next(it)]
    stream.close()  # the HTTP connection closes; the API cancels the gRPC stream, dflash_bls the engine request
    assert all(c.choices[0].finish_reason is None for c in first)
    wait_cancelled(api, before)
    # a non-streamed request whose client gives up (~0.9 s of work here, the client waits 0.1 s)
    before = metrics(api).get("dflash_cancelled_requests_total", 0)
    with pytest.raises(openai.APITimeoutError):
        api.client.with_options(timeout=0.1).completions.create(**long)
    wait_cancelled(api, before)
    r = api.client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    assert r.choices[0].text == expected(models, "hello world", 8)[0]


def test_full_queue_gets_503_in_the_error_shape(models):
    """An engine taking one request and queueing one more refuses the rest as overloaded: HTTP 503 with
    Retry-After. The build is `decoupled: false` (dflash_unary, no dflash_bls: serve --openai-port used to
    refuse it), so a streamed request gets its whole text in one chunk. The API runs in this process here
    (OpenAIFrontend, port 0, reading the repository as `serve` does)."""
    from dflash_trt.serving.openai_api import OpenAIFrontend
    from dflash_trt.serving.server import TritonServer

    repo = api_repo(models, "repo_queue", max_batch=1, max_queue=1, decoupled=False)
    long = dict(model="tiny", prompt="over the lazy dog", max_tokens=MAX_SEQ - 20, temperature=0)
    with TritonServer(repo, startup_timeout=300) as srv:
        api = OpenAIFrontend(repo, srv.grpc_url, port=0, model_name="tiny").start()
        try:
            client = openai.OpenAI(base_url=api.url, api_key="none", max_retries=0, timeout=300)

            def run(_):
                try:
                    return client.completions.create(extra_body={"ignore_eos": True}, **long).choices[0].finish_reason
                except openai.APIStatusError as e:
                    return e.status_code, {**e.body, "retry-after": e.response.headers.get("retry-after")}

            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(run, range(6)))
            kw = dict(model="tiny", prompt="hello world", max_tokens=12, temperature=0)
            streamed, chunks = _stream_text(client.completions.create(stream=True, **kw))
            assert streamed == expected(models, "hello world", 12)[0] == client.completions.create(**kw).choices[0].text
        finally:
            api.stop()
    refused = [g for g in got if g != "length"]
    assert refused and len(refused) <= 4, got
    for status, body in refused:
        assert status == 503 and body["type"] == "service_unavailable" and "overloaded" in body["message"], body
        assert body["retry-after"] == "1", body
