"""Request validation, error mapping and chat rendering of the OpenAI-compatible API
(serving/openai_schema.py, openai_api.py), without a server; tests/test_openai_api.py runs the API
against a real `dflash-trt serve --openai-port`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install 'dflash-trt[serve]')")

from conftest import tiny_tokenizer  # noqa: E402

from dflash_trt.serving.openai_api import render_chat, server_error, validation_error  # noqa: E402
from dflash_trt.serving.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402

MAX_SEQ = 256
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "The quick brown fox"},
    {"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "wörld ✓"}]},
]


def _api_error(fn) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn()
    return e.value


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(n=2), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
        (dict(logprobs=2), "logprobs"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(prompt=[1, 2, 3]), "prompt"),
        (dict(prompt=["a", "b"]), "prompt"),
        (dict(prompt=""), "prompt"),
        # the OpenAI API's ranges (narrower than the engine's), then SamplingParams' own rules
        (dict(temperature=3.0), "temperature"),
        (dict(temperature=1e9), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(presence_penalty=5.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=17), "min_tokens"),
    ],
)
def test_completion_request_refuses_naming_the_field(kw, param):
    req = CompletionRequest(**{"model": "m", "prompt": "hi", **kw})
    e = _api_error(lambda: req.to_generation(MAX_SEQ))
    assert (e.status, e.param) == (400, param) and e.message.startswith(param)
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param, "code": None}}


def test_completion_request_defaults_are_openai_ones():
    g = CompletionRequest(model="m", prompt=["hi"], stop="\n", seed=3).to_generation(MAX_SEQ)
    assert (g.prompt, g.max_tokens, g.stream) == ("hi", 16, False)
    assert g.inputs == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": 3,
        "stop_words": ["\n"],
        "end_id": None,
        "exclude_input_in_output": True,
    }
    g = CompletionRequest(model="m", prompt="hi", max_tokens=None, ignore_eos=True, echo=True).to_generation(99)
    assert g.max_tokens == 99 and g.inputs["end_id"] == -1 and g.inputs["exclude_input_in_output"] is False
    g = CompletionRequest(model="m", prompt="hi", presence_penalty=0.5, min_tokens=2).to_generation(99)
    assert (g.inputs["presence_penalty"], g.inputs["min_tokens"]) == (0.5, 2) and "frequency_penalty" not in g.inputs


def test_chat_request_fields():
    msgs = [{"role": "user", "content": "hi"}]
    g = ChatCompletionRequest(model="m", messages=msgs, max_completion_tokens=5, stop=["a", "b"]).to_generation(99)
    assert g.max_tokens == 5 and g.inputs["stop_words"] == ["a", "b"]
    assert ChatCompletionRequest(model="m", messages=msgs).to_generation(99).max_tokens == 99  # the context's rest
    for kw, param in [
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(max_tokens=3, max_completion_tokens=4), "max_completion_tokens"),
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (dict(response_format={"type": "json_object"}), "response_format"),
    ]:
        req = ChatCompletionRequest(**{"model": "m", "messages": msgs, **kw})
        assert _api_error(lambda r=req: r.to_generation(99)).param == param


def test_validation_errors_name_the_field_path():
    e = validation_error([{"loc": ("body", "messages", 0, "content", "str"), "msg": "bad", "type": "string_type"}])
    assert (e.status, e.param, e.message) == (400, "messages[0].content", "messages[0].content: bad")
    assert validation_error([{"loc": ("body", "foo"), "msg": "Extra inputs are not permitted"}]).param == "foo"
    assert validation_error([{"loc": ("body", 7), "msg": "x", "type": "json_invalid"}]).param is None


def test_front_door_errors_map_to_statuses_and_api_fields():
    e = server_error("server overloaded: max_queue=4 requests already waiting; retry later", chat=False)
    assert (e.status, e.type) == (503, "service_unavailable")
    # new requests while `serve` drains on SIGTERM (Triton has unloaded the model)
    assert server_error("Request for unknown model: 'dflash_bls' has no available versions", chat=False).status == 503
    e = server_error("[request id: ab] text_input: prompt has 300 tokens but ...", chat=True)
    assert (e.status, e.param, e.message) == (400, "messages", "messages: prompt has 300 tokens but ...")
    e = server_error("max_tokens=0: must be >= 1", chat=True, max_field="max_completion_tokens")
    assert (e.status, e.param) == (400, "max_completion_tokens") and e.message.startswith("max_completion_tokens=0")
    assert server_error("dflash_bls: RuntimeError: boom", chat=False).status == 500


def test_render_chat_gives_the_ids_apply_chat_template_gives(tmp_path):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    codec = TextCodec.from_dir(tmp_path)
    msgs = ChatCompletionRequest(model="m", messages=CHAT).template_messages()
    text = render_chat(codec, msgs)
    assert codec.encode(text, chat=False) == template_ids(tok, msgs)


def template_ids(tok, msgs) -> list[int]:
    """transformers' apply_chat_template(tokenize=True), as dflash_trt/api.py encode() reads it."""
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class _BosTokenizer:
    """Characters as ids; add_special_tokens=True puts BOS (id 0) first, as Llama tokenizers do."""

    bos_token, chat_template = "^", "yes"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "^" + "".join(m["content"] for m in messages) + ">"

    def __call__(self, text, add_special_tokens=True):
        ids = [0 if c == "^" else ord(c) for c in text]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}


def test_render_chat_drops_the_template_bos_the_tokenizer_adds_back():
    text = render_chat(TextCodec(_BosTokenizer()), [{"role": "user", "content": "ab"}])
    assert text == "ab>"


def test_http_errors_have_the_openai_shape_without_triton(tmp_path):
    """The app on uvicorn with no Triton behind it: what pydantic refuses is a 400 naming the field,
    an unknown model a 404, and a valid request the unreachable Triton a 503."""
    openai = pytest.importorskip("openai", reason="openai not installed (pip install 'dflash-trt[test]')")
    from dflash_trt.serving.openai_api import OpenAIFrontend, RepoInfo
    from dflash_trt.serving.server import free_port

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    repo = RepoInfo(tmp_path / "tok", tmp_path / "tiny", MAX_SEQ)
    api = OpenAIFrontend(repo, f"127.0.0.1:{free_port()}", port=0).start()
    try:
        client = openai.OpenAI(base_url=api.url, api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        for kw, param in [
            (dict(prompt=5), "prompt"),
            (dict(stop=[1, 2]), "stop"),
            (dict(extra_body={"frobnicate": 1}), "frobnicate"),
            (dict(n=2), "n"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(**{"model": "tiny", "prompt": "hi", **kw})
            body = e.value.body
            assert (body["param"], body["type"], body["code"]) == (param, "invalid_request_error", None), body
            assert body["message"].startswith(param)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 3}])
        assert e.value.body["param"] == "messages[0].content"
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=CHAT)
        assert e.value.body["param"] == "model"
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable"
    finally:
        api.stop()


def test_the_default_model_id_is_the_builds_target(tmp_path):
    """serve --model-repo OUT/model_repo of a build reports the build's target (a registry name or a
    folder's name), not the engine's `target` folder; without a build.json, the target folder's name."""
    from dflash_trt.serving.openai_api import default_model_name

    repo, target = tmp_path / "out" / "model_repo", tmp_path / "out" / "engine" / "target"
    repo.mkdir(parents=True)
    assert default_model_name(repo, target) == "target"
    (tmp_path / "out" / "build.json").write_text(json.dumps({"config": {"target": "smollm2-135m-instruct"}}))
    assert default_model_name(repo, target) == "smollm2-135m-instruct"
    (tmp_path / "out" / "build.json").write_text(json.dumps({"config": {"target": "/models/Qwen3-8B"}}))
    assert default_model_name(repo, target) == "Qwen3-8B"
    (tmp_path / "out" / "build.json").write_text("{not json")
    assert default_model_name(repo, target) == "target"


def test_message_fields_outside_openais_are_refused():
    """As at the top level, an unknown field inside a message is refused naming its path, not dropped."""
    msgs = [{"role": "user", "content": "hi", "frobnicate": 1}]
    with pytest.raises(ValueError) as e:
        ChatCompletionRequest(model="m", messages=msgs)
    err = validation_error([{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()])  # as FastAPI reports it
    assert (err.status, err.param) == (400, "messages[0].frobnicate") and "Extra inputs" in err.message
    ok = [{"role": "assistant", "content": None, "tool_calls": [], "refusal": None}, {"role": "tool", "content": "x"}]
    assert ChatCompletionRequest(model="m", messages=ok).template_messages()[0]["tool_calls"] == []


def _guarded_api(tmp_path, **kw):
    """The app on uvicorn (port 0) with no Triton behind it."""
    from dflash_trt.serving.openai_api import OpenAIFrontend, RepoInfo
    from dflash_trt.serving.server import free_port

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    repo = RepoInfo(tmp_path / "tok", tmp_path / "tiny", MAX_SEQ)
    return OpenAIFrontend(repo, f"127.0.0.1:{free_port()}", port=0, **kw).start()


def _get(url: str) -> tuple[int, dict, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_api_key_body_bound_and_media_type_are_checked_before_the_route(tmp_path):
    """--api-key: /v1 needs the Bearer key (401 in OpenAI's error shape otherwise, streamed or not),
    /health stays open; a non-JSON media type is 415, a body over the bound 413 (declared or chunked);
    a prompt longer than max_seq_len tokens can be is refused at once, untokenized; 503 says Retry-After."""
    import time
    import urllib.request

    openai = pytest.importorskip("openai", reason="openai not installed (pip install 'dflash-trt[test]')")
    api = _guarded_api(tmp_path, api_key="s3cret", max_body_bytes=4096)
    try:
        for key in ("wrong", "s3cre", "s3cretx"):
            client = openai.OpenAI(base_url=api.url, api_key=key, max_retries=0, timeout=30)
            for stream in (False, True):
                with pytest.raises(openai.AuthenticationError) as e:
                    client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=stream)
                assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
                assert "Authorization: Bearer" in e.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        # /health needs no key: answered (503 here: no Triton behind it), not refused with 401
        status, _, body = _get(api.url.replace("/v1", "/health"))
        assert (status, body) == (503, {"ready": False})
    except BaseException:
        api.stop()
        raise
    auth = {"Authorization": "Bearer s3cret"}
    url = api.url + "/completions"
    try:
        client = openai.OpenAI(base_url=api.url, api_key="s3cret", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        status, headers, body = _post(
            url, b"model=tiny&prompt=hi", {**auth, "Content-Type": "application/x-www-form-urlencoded"}
        )
        assert status == 415 and "application/json" in body["error"]["message"], body
        status, _, body = _post(
            url,
            json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode(),
            {**auth, "Content-Type": "application/json"},
        )
        assert status == 413 and "4096 bytes" in body["error"]["message"], body
        chunks = iter([b'{"model": "tiny", "prompt": "', b"x" * 5000, b'"}'])
        req = urllib.request.Request(
            url, data=chunks, headers={**auth, "Content-Type": "application/json"}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:  # no Content-Length: counted as it arrives
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413 and "bytes" in json.loads(e.value.read())["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:  # Triton unreachable: retry later
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    finally:
        api.stop()
    big = _guarded_api(tmp_path / "big")  # the default bound (8 MiB): a 2 MB prompt passes it
    try:
        client = openai.OpenAI(base_url=big.url, api_key="none", max_retries=0, timeout=30)
        for call in (
            lambda: client.completions.create(model="tiny", prompt="ab " * 700_000, max_tokens=2),
            lambda: client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "ab " * 700_000}]
            ),
        ):
            t0 = time.monotonic()
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.body["param"] in ("prompt", "messages") and "max_seq_len=256" in e.value.body["message"]
            assert time.monotonic() - t0 < 2.0, "refused only after tokenizing"
    finally:
        big.stop()
