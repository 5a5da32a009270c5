"""Serving pieces without a server, engine side: the orchestrator's continuous batching /
cancellation / error isolation / stop matching / metrics, and the engine loader."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from conftest import tiny_drafter, tiny_model_dir, tiny_target
from serving_common import ListSink, serve_one

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.engine import SpecEngine
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.target import TargetModel
from dflash_trt.serving.engine_factory import load_engine_factory
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import Sampling, TokenRequest
from dflash_trt.serving.stops import TextStop

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


# ---- orchestrator -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    t = tiny_target("qwen3")
    return t, tiny_drafter(t, block_size=4)


def test_orchestrator_batches_streams_and_isolates_errors(pair):
    t, d = pair
    orch = Orchestrator(lambda: SpecEngine(t, d, max_batch=3, max_seq_len=64, proposer="dflash")).start()
    try:
        prompts = [[5, 17, 42], [9, 8, 7, 6, 5], [200], [1, 2, 3, 4, 5, 6, 7, 8], [11, 12], [100, 101, 102]]
        sinks = [ListSink() for _ in prompts]
        bad = [ListSink(), ListSink()]
        orch.submit(TokenRequest([1] * 80, Sampling(max_tokens=3)), bad[0])  # longer than the context
        for i, (p, s) in enumerate(zip(prompts, sinks)):
            orch.submit(TokenRequest(p, Sampling(max_tokens=5 + 3 * i, stream=i % 2 == 0)), s)
        orch.submit(TokenRequest([1, 999], Sampling(max_tokens=3)), bad[1])  # outside the vocabulary
        for s in sinks + bad:
            assert s.done.wait(60)
        assert "max_seq_len=64" in bad[0].errors[0] and "vocabulary" in bad[1].errors[0]
        for i, (p, s) in enumerate(zip(prompts, sinks)):
            ref = generate_baseline(t, [p], SamplingParams(max_new_tokens=5 + 3 * i)).tokens[0]
            last = s.msgs[-1][0]
            assert s.ids() == last.output_ids == ref and not s.errors
            assert [f for _, f in s.msgs] == [False] * (len(s.msgs) - 1) + [True]
            assert last.finish_reason == "length" and last.num_input_tokens == len(p)
            assert last.num_draft_tokens == 3 * last.num_verify_steps
            assert (len(s.msgs) > 1) == (i % 2 == 0 and len(ref) > 2)
    finally:
        orch.stop()


def test_orchestrator_cancel_stop_sequence_and_engine_failure(pair):
    t, d = pair
    orch = Orchestrator(lambda: SpecEngine(t, d, max_batch=4, max_seq_len=128)).start()
    try:
        prompt = [5, 17, 42]
        ref = generate_baseline(t, [prompt], SamplingParams(max_new_tokens=40)).tokens[0]
        gone, keyed, stopped, ok = ListSink(cancel_after=2), ListSink(), ListSink(), ListSink()
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=100, stream=True)), gone)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=100, stream=True), request_key="k1"), keyed)
        stop = ref[6:8]
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40), stop_sequences=[stop]), stopped)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40)), ok)
        # text stop strings (serving/stops.py) over a codec whose token i is one letter
        letters = type("Letters", (), {"decode": staticmethod(lambda ids: "".join(chr(97 + i % 26) for i in ids))})
        word = letters.decode(ref[9:11])
        through = next(k for k in range(1, len(ref) + 1) if word in letters.decode(ref[:k]))
        texted, at_end = ListSink(), ListSink()
        for sink, n in ((texted, 40), (at_end, through)):  # at_end: the stop and max_tokens end the same step
            orch.submit(TokenRequest(prompt, Sampling(max_tokens=n), text_stop=TextStop(letters, [word]).match), sink)
        while not keyed.msgs:
            time.sleep(0.01)
        orch.cancel("k1")
        for s in (gone, keyed, stopped, ok, texted, at_end):
            assert s.done.wait(60)
        for s in (texted, at_end):
            assert (s.msgs[-1][0].output_ids, s.msgs[-1][0].finish_reason) == (ref[:through], "stop")
        assert gone.closed and len(gone.msgs) == 2
        assert keyed.msgs[-1][0].finish_reason == "cancelled" and keyed.msgs[-1][1]
        first = next(i for i in range(1, len(ref)) if ref[i - 1 : i + 1] == stop)
        assert stopped.msgs[-1][0].output_ids == ref[: first + 1] and stopped.msgs[-1][0].finish_reason == "stop"
        assert ok.msgs[-1][0].output_ids == ref
        # an engine failure fails the running requests, then a fresh engine serves the next ones
        real_step = SpecEngine.step
        boom = ListSink()
        try:
            SpecEngine.step = lambda self: (_ for _ in ()).throw(RuntimeError("kaput"))
            orch.submit(TokenRequest(prompt, Sampling(max_tokens=5)), boom)
            assert boom.done.wait(30)
        finally:
            SpecEngine.step = real_step
        assert "kaput" in boom.errors[0]
        after = ListSink()
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40)), after)
        assert after.done.wait(60) and after.msgs[-1][0].output_ids == ref
        assert orch.num_running == 0
    finally:
        orch.stop()


class _DeliveredMetrics:
    def __init__(self):
        self.delivered_tokens = 0

    def __getattr__(self, name):  # every other NullMetrics hook: ignored
        return lambda *a, **k: None

    def delivered(self, tokens):
        self.delivered_tokens += tokens


def test_output_token_metric_counts_only_delivered_tokens(pair):
    """The output-token counter counts what clients received: not the tokens cut after a stop sequence, nor
    those of a cancelled request after its cancel, nor those of a client that is gone (issue #30 item 5)."""
    t, d = pair
    metrics = _DeliveredMetrics()
    orch = Orchestrator(lambda: SpecEngine(t, d, max_batch=5, max_seq_len=128), metrics=metrics).start()
    try:
        prompt = [5, 17, 42]
        ref = generate_baseline(t, [prompt], SamplingParams(max_new_tokens=40)).tokens[0]
        stop = ref[6:8]
        gone, keyed, ok = ListSink(cancel_after=2), ListSink(), ListSink()
        stopped, streamed_stop = ListSink(), ListSink()
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=100, stream=True)), gone)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=100, stream=True), request_key="k1"), keyed)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40), stop_sequences=[stop]), stopped)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40, stream=True), stop_sequences=[stop]), streamed_stop)
        orch.submit(TokenRequest(prompt, Sampling(max_tokens=40)), ok)
        while not keyed.msgs:
            time.sleep(0.01)
        orch.cancel("k1")
        sinks = (gone, keyed, stopped, streamed_stop, ok)
        for s in sinks:
            assert s.done.wait(60)
    finally:
        orch.stop()
    received = sum(len(p.output_ids) - p.num_prev for s in sinks for p, _ in s.msgs if p.finish_reason != "cancelled")
    assert stopped.msgs[-1][0].finish_reason == streamed_stop.msgs[-1][0].finish_reason == "stop"
    assert streamed_stop.ids() == stopped.msgs[-1][0].output_ids
    assert gone.closed and metrics.delivered_tokens == received


def test_end_id_outside_the_vocabulary_is_refused_in_one_line(pair):
    """end_id is checked against the target's vocabulary at submit (issue #30 item 9)."""
    t, d = pair
    orch = Orchestrator(lambda: SpecEngine(t, d, max_batch=2, max_seq_len=64)).start()
    try:
        bad, ok = ListSink(), ListSink()
        V = t.vocab_size
        orch.submit(TokenRequest([5, 17, 42], Sampling(max_tokens=4, end_id=V)), bad)
        orch.submit(TokenRequest([5, 17, 42], Sampling(max_tokens=4, end_id=V - 1)), ok)
        assert bad.done.wait(60) and ok.done.wait(60)
    finally:
        orch.stop()
    assert bad.errors == [f"end_id={V}: outside the vocabulary 0..{V - 1} (give a token id, or -1 to ignore EOS)"]
    assert not bad.msgs and not ok.errors and ok.msgs[-1][1]


def _dspark_drafter(target, block_size: int = 4):
    """A tiny DSpark drafter with a (random) confidence head."""
    import dataclasses

    from dflash_trt.config import DrafterConfig
    from dflash_trt.families import for_architectures
    from dflash_trt.modeling.drafter import DFlashDrafter

    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=block_size)
    fields = {"markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True}
    fields = {**for_architectures(["DSparkDraftModel"]).DEFAULTS, **fields}
    torch.manual_seed(3)
    return DFlashDrafter(dataclasses.replace(cfg, architectures=["DSparkDraftModel"], family_fields=fields)).bind(
        target
    )


def test_engine_loader_passes_the_draft_length(tmp_path):
    """draft_length reaches the engine; a drafter without a confidence head fails at the first engine (load
    time in Triton), and confidence without a cutoff before any model loads."""
    target = TargetModel.from_pretrained(tiny_model_dir(tmp_path / "target"), dtype=torch.float32)
    tiny_drafter(target).save_pretrained(tmp_path / "plain")
    _dspark_drafter(target).save_pretrained(tmp_path / "dspark")
    with pytest.raises(DFlashError, match="draft_length=confidence needs draft_cutoff > 0"):
        load_engine_factory(str(tmp_path / "nope"), str(tmp_path), draft_length="confidence")
    make = load_engine_factory(
        str(tmp_path / "target"), str(tmp_path / "plain"), dtype="float32", draft_cutoff=0.2, draft_length="confidence"
    )
    with pytest.raises(DFlashError, match="no confidence head"):
        Orchestrator(make)
    make = load_engine_factory(
        str(tmp_path / "target"), str(tmp_path / "dspark"), dtype="float32", draft_cutoff=0.2, draft_length="confidence"
    )
    assert make().length_source == "confidence"


class _PositionMetrics:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):  # every other NullMetrics hook: ignored
        return lambda *a, **k: None

    def positions(self, accepted_at, predicted_at):
        self.calls.append((accepted_at, predicted_at))


def test_orchestrator_reports_per_position_and_predicted_acceptance():
    """perf_metrics of a finished request carry per-position acceptance and, with a confidence head, the
    head's predicted per-position acceptance and tau; the metrics hook gets the per-position counts."""
    t = tiny_target("qwen3")
    for drafter, kw, predicted in (
        (tiny_drafter(t, block_size=4), {}, False),
        (_dspark_drafter(t), {"draft_cutoff": 0.05, "draft_length": "confidence"}, True),
    ):
        metrics = _PositionMetrics()
        make = functools.partial(SpecEngine, t, drafter, max_batch=2, max_seq_len=64, **kw)
        orch = Orchestrator(make, metrics=metrics)
        orch.start()
        try:
            sink = ListSink()
            orch.submit(TokenRequest([5, 17, 42], Sampling(max_tokens=10, return_perf_metrics=True)), sink)
            assert sink.done.wait(60) and not sink.errors
        finally:
            orch.stop()
        last = sink.msgs[-1][0]
        perf = last.perf
        assert len(perf["per_position_acceptance"]) == 3
        ref = generate_baseline(t, [[5, 17, 42]], SamplingParams(max_new_tokens=10)).tokens[0]
        assert last.output_ids == ref
        accepted_at, predicted_at = metrics.calls[0]
        steps = sum(perf["accept_hist"])
        assert [a / steps for a in accepted_at] == pytest.approx(perf["per_position_acceptance"])
        if predicted:
            assert len(perf["predicted_per_position"]) == 3 and len(predicted_at) == 3
            assert perf["predicted_tau"] == pytest.approx(1 + sum(perf["predicted_per_position"]))
        else:
            assert "predicted_tau" not in perf and predicted_at == []


class _SourceMetrics(_PositionMetrics):
    def __init__(self):
        super().__init__()
        self.copied_calls = []

    def copied(self, draft_tokens, accepted_tokens):
        self.copied_calls.append((draft_tokens, accepted_tokens))


@pytest.mark.parametrize("proposer", ["ngram", "hybrid"])
def test_orchestrator_reports_draft_sources(proposer):
    """perf_metrics of a finished request carry `sources` (steps / drafts / accepted of the drafter and of the
    drafts copied from the request's own text), and the metrics hook counts the copied drafts as they run."""
    t = tiny_target("qwen3")
    metrics = _SourceMetrics()
    make = functools.partial(
        SpecEngine, t, tiny_drafter(t, block_size=4), max_batch=2, max_seq_len=96, proposer=proposer
    )
    prompt = [5, 6, 7, 8, 9] * 4
    last = serve_one(make, TokenRequest(prompt, Sampling(max_tokens=24, return_perf_metrics=True)), metrics=metrics)[0]
    assert last.output_ids == generate_baseline(t, [prompt], SamplingParams(max_new_tokens=24)).tokens[0]
    src = last.perf["sources"]
    assert set(src) == {"drafter", "copied"}
    assert src["drafter"]["steps"] + src["copied"]["steps"] == sum(last.perf["accept_hist"])
    assert src["copied"]["drafts"] > 0  # the tiny target repeats itself
    assert [sum(c) for c in zip(*metrics.copied_calls)] == [src["copied"]["drafts"], src["copied"]["accepted"]]
    if proposer == "ngram":
        assert src["drafter"]["drafts"] == 0
