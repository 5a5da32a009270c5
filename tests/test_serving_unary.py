"""A `decoupled: false` model repository over a real tritonserver (issue #30 item 10): the engine model
is unary, so the ensemble is unary too and answers HTTP /v2/models/ensemble/infer and gRPC ModelInfer
with the exact text; dflash_unary keeps working over the unary engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed (pip install 'dflash-trt[serve]')")

from conftest import tiny_pair_dir  # noqa: E402
from test_serving import BLOCK, expected, tiny_repo  # noqa: E402

from dflash_trt.serving.client import DFlashClient, ServingError  # noqa: E402
from dflash_trt.serving.server import TritonServer  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # conftest.py
PROMPT = "héllo wörld ✓ 漢字"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_unary")
    target = tiny_pair_dir(root, block_size=BLOCK)
    return root, target, TextCodec.from_dir(root / "target")


@pytest.fixture(scope="module")
def server(models):
    repo = tiny_repo(models, "repo_unary", max_batch=8, decoupled=False)
    with TritonServer(repo, startup_timeout=300) as srv:
        yield srv


def http_infer(server, model: str, inputs: dict) -> dict:
    body = {"inputs": [{"name": k, "shape": [1, 1], "datatype": t, "data": [v]} for k, (t, v) in inputs.items()]}
    req = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/infer", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": json.loads(e.read())["error"]}
    return {o["name"]: o["data"][0] for o in out["outputs"]}


def test_unary_ensemble_answers_http_infer_with_the_exact_text(models, server):
    text, n_out, n_in = expected(models, PROMPT, 24)
    r = http_infer(server, "ensemble", {"text_input": ("BYTES", PROMPT), "max_tokens": ("INT32", 24)})
    assert (r["text_output"], r["num_output_tokens"], r["num_input_tokens"]) == (text, n_out, n_in)
    # the prompt echoed, as tensorrtllm_backend's ensemble does with exclude_input_in_output false
    r = http_infer(
        server,
        "ensemble",
        {"text_input": ("BYTES", PROMPT), "max_tokens": ("INT32", 24), "exclude_input_in_output": ("BOOL", False)},
    )
    assert r["text_output"] == PROMPT + text


def test_unary_ensemble_answers_grpc_model_infer(models, server):
    with DFlashClient(server.grpc_url, model="ensemble") as c:
        r = c.generate(PROMPT, max_tokens=16)
        assert r["text"] == expected(models, PROMPT, 16)[0]
        # and so does dflash_unary, over the unary engine
        assert c.generate(PROMPT, max_tokens=16, model="dflash_unary")["text"] == r["text"]


def test_unary_ensemble_stop_string_and_stream_refusal(models, server):
    text = expected(models, PROMPT, 24)[0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = http_infer(
        server,
        "ensemble",
        {"text_input": ("BYTES", PROMPT), "max_tokens": ("INT32", 24), "stop_words": ("BYTES", stop)},
    )
    assert (r["text_output"], r["finish_reason"]) == (text[: text.find(stop)], "stop")
    r = http_infer(
        server, "ensemble", {"text_input": ("BYTES", PROMPT), "max_tokens": ("INT32", 4), "stream": ("BOOL", True)}
    )
    assert "stream:" in r["error"] and "decoupled" in r["error"]


def test_unary_ensemble_metadata_advertises_what_it_serves(server):
    with urllib.request.urlopen(f"{server.http_url}/v2/models/ensemble/config", timeout=10) as r:
        cfg = json.loads(r.read())
    assert cfg["max_batch_size"] == 1  # one prompt per request; dflash_unary serves batches
    with DFlashClient(server.grpc_url, model="ensemble") as c, pytest.raises(ServingError):
        c.generate_batch(["a", "b"], max_tokens=2)
