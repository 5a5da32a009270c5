"""The text front doors over a real tritonserver (the default, decoupled build), issue #30: text stop
strings on every path, each unary request answered when it is done, requests of several rows."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton not installed (pip install 'dflash-trt[serve]')")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed (pip install 'dflash-trt[serve]')")

from conftest import tiny_pair_dir  # noqa: E402
from test_serving import BLOCK, expected, metrics, tiny_repo  # noqa: E402

from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.decoding.loop import generate_baseline  # noqa: E402
from dflash_trt.serving.client import DFlashClient, ServingError, build_inputs  # noqa: E402
from dflash_trt.serving.server import TritonServer  # noqa: E402
from dflash_trt.serving.text import TextCodec  # noqa: E402
from dflash_trt.serving.trtllm_inputs import bad_word_variants  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # conftest.py
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_text")
    target = tiny_pair_dir(root, block_size=BLOCK)
    return root, target, TextCodec.from_dir(root / "target")


@pytest.fixture(scope="module")
def server(models):
    with TritonServer(tiny_repo(models, "repo_text", max_batch=8), startup_timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with DFlashClient(server.grpc_url) as c:
        yield c


def mid_token_stop(models, prompt: str, n: int):
    """A 2-character stop string whose first occurrence in the greedy output starts inside a token
    (so no token sequence of the word alone matches it), the text before it, and the tokens through
    the one that completes it."""
    _, target, codec = models
    toks = generate_baseline(target, [codec.encode(prompt)], SamplingParams(max_new_tokens=n)).tokens[0]
    text = codec.decode(toks)
    bounds = {len(codec.decode(toks[:k])) for k in range(len(toks) + 1)}
    for pos in range(1, len(text) - 2):
        stop = text[pos : pos + 2]
        if pos not in bounds and text.find(stop) == pos and stop.strip() and "\ufffd" not in stop:
            keep = next(k for k in range(1, len(toks) + 1) if stop in codec.decode(toks[:k]))
            return stop, text[:pos], keep
    pytest.skip("no mid-token stop string in this output")


@pytest.mark.parametrize("model", ["dflash_unary", "dflash_bls", "ensemble"])
def test_stop_string_inside_a_token_cuts_the_text_and_ends_the_request(models, server, client, model):
    stop, before, keep = mid_token_stop(models, PROMPT, 40)
    m0 = metrics(server).get("dflash_output_tokens_total", 0.0)
    if model == "dflash_unary":
        r = client.generate(PROMPT, max_tokens=40, stop_words=[stop], model=model)
    else:
        r = client.stream_text(PROMPT, max_tokens=40, stop_words=[stop], model=model)
    assert (r["text"], r["finish_reason"], r["num_output_tokens"]) == (before, "stop", keep)
    # the engine stopped there: only the tokens through the stop string were delivered and counted (the
    # engine counts the final response's tokens just after sending it: read until they are, 10 s at most)
    deadline = time.monotonic() + 10
    while metrics(server)["dflash_output_tokens_total"] - m0 < keep and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(server)["dflash_output_tokens_total"] - m0 == keep


@pytest.mark.parametrize("model", ["dflash_bls", "ensemble"])
def test_streamed_text_never_shows_the_start_of_a_stop_string(models, client, model):
    stop, before, _ = mid_token_stop(models, PROMPT, 40)
    longer = stop + "\x00never"  # starts like the output at the stop, never completes: nothing is cut
    whole = client.generate(PROMPT, max_tokens=40)["text"]
    assert whole.startswith(before + stop)
    seen = ""
    for chunk in client.stream(PROMPT, max_tokens=40, stop_words=[longer], model=model):
        seen += chunk["text"]
        if not chunk["final"]:  # a possible start of `longer` is held back until it cannot be one
            assert not any(longer.startswith(seen[i:]) for i in range(len(seen)) if seen[i:])
    assert seen == whole


def _timed(client, out, name, **kw):
    t0 = time.perf_counter()
    out[name] = (client.generate(PROMPT, model="dflash_unary", **kw), time.perf_counter() - t0)
    out[name + "_done"] = time.perf_counter()


def test_short_unary_request_is_answered_before_a_long_one_started_first(models, server):
    """Head of line: a short request must not wait for a long one it shares an instance or a dynamic batch with."""
    out = {}
    with DFlashClient(server.grpc_url) as a, DFlashClient(server.grpc_url) as b:
        a.generate(PROMPT, max_tokens=2)  # warm
        long = threading.Thread(target=_timed, args=(a, out, "long"), kwargs=dict(max_tokens=200, end_id=-1))
        long.start()
        deadline = time.monotonic() + 60
        while metrics(server).get("dflash_running_requests", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the long request is generating: the short one arrives behind it
        _timed(b, out, "short", max_tokens=8)
        long.join()
    assert out["long"][0]["num_output_tokens"] == 200 and out["short"][0]["num_output_tokens"] == 8
    assert out["short"][0]["text"] == expected(models, PROMPT, 8)[0]
    assert out["short_done"] < out["long_done"], (out["short"][1], out["long"][1])


def test_a_request_of_two_rows_gets_both_texts_in_row_order(models, client):
    prompts = ["hello world", "def add(a, b):"]
    got = client.generate_batch(prompts, max_tokens=12)
    assert [(r["text"], r["num_output_tokens"]) for r in got] == [expected(models, p, 12)[:2] for p in prompts]
    # rows with different stop words (padded with empty strings) stop each at its own
    stop, before, keep = mid_token_stop(models, PROMPT, 40)
    got = client.generate_batch([PROMPT, PROMPT], max_tokens=40, stop_words=[stop])
    assert [(r["text"], r["finish_reason"], r["num_output_tokens"]) for r in got] == [(before, "stop", keep)] * 2


def test_unary_front_door_refuses_stream_in_one_line(client):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="stream: dflash_unary is not decoupled"):
        client._client.infer("dflash_unary", build_inputs(PROMPT, 4, stream=True))


# ---- tensorrtllm_backend's extra inputs (issue #30 item 5) ----------------------------------------
def test_tensorrtllm_backend_logit_controls_are_applied_on_every_path(models, client):
    """Penalties, min_tokens and bad_words reach the engine through dflash_unary, dflash_bls and the ensemble
    and give the in-process baseline's text with the same SamplingParams (which differs from the plain text)."""
    _, target, codec = models
    plain = generate_baseline(target, [codec.encode(PROMPT)], SamplingParams(max_new_tokens=24)).tokens[0]
    bad = next(w for w in (codec.decode([t]).strip() for t in plain[2:]) if w)
    kw = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_tokens=6)
    params = SamplingParams(
        max_new_tokens=24, bad_words_ids=codec.encode_stop_words(bad_word_variants([bad])), ignore_eos=False, **kw
    )
    toks = generate_baseline(target, [codec.encode(PROMPT)], params).tokens[0]
    assert toks != plain
    want = (codec.decode(toks), len(toks))
    got = client.generate(PROMPT, max_tokens=24, bad_words=[bad], **kw)
    assert (got["text"], got["num_output_tokens"]) == want
    for model in ("dflash_bls", "ensemble"):
        got = client.stream_text(PROMPT, max_tokens=24, bad_words=[bad], model=model, **kw)
        assert (got["text"], got["num_output_tokens"]) == want, model


@pytest.mark.parametrize("model", ["dflash_unary", "ensemble"])
def test_tensorrtllm_backend_inputs_accepted_or_refused_in_one_line(models, client, model):
    one = {"pad_id": np.array([[0]], np.int32), "beam_width": np.array([[1]], np.int32)}
    one.update(return_num_input_tokens=np.array([[True]]), return_num_output_tokens=np.array([[True]]))
    one["num_return_sequences"] = np.array([[1]], np.int32)
    run = client.generate if model == "dflash_unary" else client.stream_text
    r = run(PROMPT, max_tokens=8, model=model, extra=one)
    assert (r["text"], r["num_output_tokens"]) == expected(models, PROMPT, 8)[:2] and r["num_input_tokens"]
    for name, value, msg in [
        ("beam_width", np.array([[2]], np.int32), "beam_width=2: beam search is not supported"),
        ("num_return_sequences", np.array([[3]], np.int32), "num_return_sequences=3"),
        ("return_log_probs", np.array([[True]]), "return_log_probs: log probabilities are not returned"),
        ("repetition_penalty", np.array([[0.0]], np.float32), "repetition_penalty=0.0: must be"),
        ("min_tokens", np.array([[9]], np.int32), "min_tokens=9: must be an integer in 0..max_tokens=8"),
    ]:
        with pytest.raises(ServingError, match=msg):
            run(PROMPT, max_tokens=8, model=model, extra={name: value})
