"""Serving pieces without a server, what requests and repositories become: tokenizer and
detokenisation, text stop strings, request parsing and response tensors, the engine loader, and
model-repository filling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_drafter, tiny_model_dir, tiny_tokenizer

from dflash_trt.config import SamplingParams
from dflash_trt.errors import DFlashError
from dflash_trt.modeling.target import TargetModel
from dflash_trt.serving.engine_factory import load_engine_factory
from dflash_trt.serving.orchestrator import Orchestrator
from dflash_trt.serving.protocol import (
    DIRECT_TEXT_INPUTS,
    TEXT_INPUTS,
    RequestError,
    Sampling,
    batch_rows,
    parse_text_request,
    parse_token_request,
    progress_from,
    token_outputs,
)
from dflash_trt.serving.repo import (
    default_template_dir,
    default_values,
    fill_model_repo,
    override_parameter,
    placeholders,
)
from dflash_trt.serving.stops import TextStop, cut, holdback
from dflash_trt.serving.text import StreamDetokenizer, TextCodec, join_stop_sequences, split_stop_sequences, text_delta
from dflash_trt.serving.trtllm_inputs import bad_word_variants, flatten_words


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return d


# ---- text -------------------------------------------------------------------------------------
def test_light_tokenizer_matches_autotokenizer(tok_dir):
    light, hf = TextCodec.from_dir(tok_dir, backend="light"), TextCodec.from_dir(tok_dir, backend="transformers")
    assert light.light and not hf.light
    for chat in (False, True):
        for t in ["hello world", "héllo wörld ✓ 漢字 <|im_end|> x", "def add(a, b):\n    return a + b\n"]:
            assert light.encode(t, chat) == hf.encode(t, chat)
    ids = list(range(hf.vocab_size))
    assert light.decode(ids) == hf.decode(ids)
    assert (light.vocab_size, light.eos_token_id) == (hf.vocab_size, hf.eos_token_id)
    assert light.encode_stop_words(["fox", ""]) == hf.encode_stop_words(["fox"])


def test_streamed_chunks_concatenate_exactly(tok_dir):
    codec = TextCodec.from_dir(tok_dir)
    rng = np.random.default_rng(0)
    texts = ["漢字 ✓ héllo", "ünïcode ✓✓ 漢"]
    seqs = [codec.encode(t, chat=False) for t in texts]
    byte_ids = [codec.tok.backend.token_to_id(c) for c in "\u00e6\u00bc\u00a2"]  # the 3 byte tokens of '漢'
    assert None not in byte_ids
    seqs += [byte_ids * 3, byte_ids[:2] + [5] + byte_ids]  # split characters, and an invalid sequence
    seqs += [list(rng.integers(0, codec.vocab_size, 40)) for _ in range(20)]  # random bytes: invalid UTF-8
    for ids in seqs:
        full = codec.decode(ids)
        for _ in range(3):
            cuts = sorted(set(rng.integers(1, len(ids), size=min(len(ids) - 1, 5)).tolist())) if len(ids) > 1 else []
            bounds = [0] + cuts + [len(ids)]
            det, stateless = StreamDetokenizer(codec), []
            chunks = []
            for a, b in zip(bounds, bounds[1:]):
                final = b == len(ids)
                chunks.append(det.add(ids[a:b], final))
                stateless.append(text_delta(codec, ids[:b], a, final))
            assert "".join(chunks) == full
            assert stateless == chunks
    # a character split across tokens is held back, never sent as U+FFFD
    det = StreamDetokenizer(codec)
    assert det.add(byte_ids[:2]) == "" and det.add(byte_ids[2:]) == "漢"


def test_stop_sequence_packing():
    assert split_stop_sequences(join_stop_sequences([[1, 2], [3]])) == [[1, 2], [3]]
    assert split_stop_sequences([]) == []


# ---- text stop strings (issue #30 item 3) ---------------------------------------------------------
def test_cut_and_holdback():
    assert cut("Paris. Next", ["."], final=False) == ("Paris", True)
    assert cut("say END", ["END", "ENDING"], final=False) == ("say ", True)
    assert cut("say EN", ["END"], final=False) == ("say ", False)  # "EN" may become "END": held back
    assert cut("say EN", ["END"], final=True) == ("say EN", False)
    assert holdback("abcab", ["abx", "b"]) == 2 and holdback("abc", ["x"]) == 0
    assert cut("END x", ["END"], final=False, start=1) == ("END x", False)  # an echoed prompt is not searched


def test_stop_strings_inside_tokens_stream_and_cut_like_the_whole_text(tok_dir):
    """A stop string the model writes inside a token (the word alone tokenizes differently) still stops;
    streamed pieces (stateful and stateless) never show it nor its possible start, and concatenate to the
    text before it; TextStop keeps the tokens through the one that completes it."""
    codec = TextCodec.from_dir(tok_dir)
    rng = np.random.default_rng(1)
    for _ in range(30):
        ids = [int(i) for i in rng.integers(0, codec.vocab_size, 30)]
        full = codec.decode(ids)
        mids = [p for p in range(1, len(full) - 3) if full[p : p + 3].strip() and "\ufffd" not in full[p : p + 3]]
        if not mids:
            continue
        pos = int(rng.choice(mids))
        stop = full[pos : pos + 3]
        pos = full.find(stop)
        keep = TextStop(codec, [stop]).match(ids, 0)
        assert keep is not None and stop in codec.decode(ids[:keep]) and stop not in codec.decode(ids[: keep - 1])
        assert TextStop(codec, [stop]).match(ids[: keep - 1], 0) is None
        det, released, stateless = StreamDetokenizer(codec), "", ""
        det.watch([stop])
        for a in range(0, keep, 3):
            b = min(a + 3, keep)
            final = b == keep
            piece = det.add(ids[a:b], final)
            stateless += text_delta(codec, ids[:b], a, final, [stop])
            released += piece
            assert full[:pos].startswith(released)  # nothing shown is ever taken back by a stop
        assert released == stateless == full[:pos] and det.stopped
    # an echoed prompt (num_prompt ids) is never searched nor cut
    prompt = codec.encode("END of the prompt")
    out = codec.encode(" and END here")
    assert (
        text_delta(codec, prompt + out, 0, True, ["END"], len(prompt))
        == codec.decode(prompt + out).split(" and")[0] + " and "
    )


def test_rows_of_a_batched_request_and_padded_stop_words():
    get = _getter(
        text_input=np.array([[b"a"], [b"b"]], dtype=object),
        max_tokens=np.array([[3], [5]], np.int32),
        stop_words=np.array([[b"x", b""], [b"y", b"z"]], dtype=object),
    )
    rows = [parse_text_request(g) for g in batch_rows(get, "text_input")]
    assert [(r.text, r.sampling.max_tokens, r.stop_words) for r in rows] == [("a", 3, ["x"]), ("b", 5, ["y", "z"])]
    assert len(batch_rows(_getter(text_input="a", max_tokens=1), "text_input")) == 1


# ---- protocol ---------------------------------------------------------------------------------
def _getter(**vals):
    arrays = {}
    for k, v in vals.items():
        if isinstance(v, str):
            v = np.array([[v.encode()]], dtype=object)
        arrays[k] = np.asarray(v).reshape(1, -1) if not isinstance(v, np.ndarray) else v
    return arrays.get


@pytest.mark.parametrize(
    "vals, field",
    [
        (dict(max_tokens=4), "text_input"),
        (dict(text_input="hi"), "max_tokens"),
        (dict(text_input="hi", max_tokens=0), "max_tokens"),
        (dict(text_input="hi", max_tokens=4, temperature=-1.0), "temperature"),
        (dict(text_input="hi", max_tokens=4, top_p=0.0), "top_p"),
        (dict(text_input="hi", max_tokens=4, top_p=1.5), "top_p"),
        (dict(text_input="hi", max_tokens=4, top_k=-2), "top_k"),
        (dict(text_input="hi", max_tokens=np.array([[4, 5]], np.int32)), "max_tokens"),
    ],
)
def test_bad_request_names_the_field(vals, field):
    with pytest.raises(RequestError, match=f"^{field}"):
        parse_text_request(_getter(**vals))


def test_token_request_roundtrip():
    req = parse_token_request(
        _getter(
            input_ids=[3, 4, 5], max_tokens=7, stream=True, stop_sequences=[1, 2, -1, 9], request_key="k", end_id=-1
        )
    )
    assert req.prompt_ids == [3, 4, 5] and req.sampling.max_tokens == 7 and req.sampling.stream
    assert req.stop_sequences == [[1, 2], [9]] and req.request_key == "k"
    p = req.sampling.to_params()
    assert p.ignore_eos and p.stop_token_ids == ()
    assert parse_token_request(_getter(cancel_key="k")).key == "k"
    with pytest.raises(RequestError, match="^input_ids"):
        parse_token_request(_getter(input_ids=np.array([[1, 2], [3, 4]], np.int32), max_tokens=2))


def test_progress_tensors_roundtrip():
    from dflash_trt.serving.protocol import Progress

    p = Progress([4, 5, 6], 1, "stop", 3, 9, 4, 3, {"e2e_time": 1.0})
    outs = token_outputs(p, prefix_ids=[1, 2], stop_words=["END"])
    assert outs["stop_words"].tolist() == [[b"END"]] and outs["num_echoed_tokens"].tolist() == [[2]]
    q = progress_from(lambda n: outs.get(n))
    assert q.output_ids == [1, 2, 4, 5, 6] and q.num_prev == 3 and q.finish_reason == "stop"
    assert (q.acceptance_rate, q.acceptance_length, q.perf) == (4 / 9, (4 + 3) / 3, {"e2e_time": 1.0})
    # a text response: exactly TEXT_OUTPUTS, its statistics the engine response's
    from dflash_trt.serving.protocol import TEXT_OUTPUTS, text_outputs

    text = text_outputs("hi", p)
    assert sorted(text) == sorted(TEXT_OUTPUTS) and text["text_output"].tolist() == [[b"hi"]]
    assert all(text[k].tolist() == outs[k].tolist() for k in TEXT_OUTPUTS if k != "text_output")


def test_tensorrtllm_backend_fields_parse_into_sampling():
    base = dict(text_input="hi", max_tokens=8)
    s = parse_text_request(_getter(**base, min_length=3, repetition_penalty=1.2, pad_id=0)).sampling
    assert (s.params.min_tokens, s.params.repetition_penalty, s.to_params().min_tokens) == (3, 1.2, 3)
    with pytest.raises(RequestError, match="^min_tokens=2, min_length=3: the same setting twice"):
        parse_text_request(_getter(**base, min_tokens=2, min_length=3))
    req = parse_text_request(_getter(**base, bad_words=np.array([[b"fox", b""]], dtype=object)))
    assert req.bad_words == ["fox"] and bad_word_variants(["fox", " dog"]) == ["fox", " fox", " dog"]
    tok = parse_token_request(_getter(input_ids=[1, 2], max_tokens=4, bad_words_ids=flatten_words([[5, 6], [7]])))
    assert tok.sampling.to_params().bad_words_ids == ((5, 6), (7,))
    assert flatten_words([]).tolist() == [[-1]]


# ---- engine loader --------------------------------------------------------------------------
def test_engine_loader_names_missing_files(tmp_path):
    with pytest.raises(DFlashError, match="config.json"):
        load_engine_factory(str(tmp_path / "nope"), str(tmp_path))
    tiny_model_dir(tmp_path / "target")
    with pytest.raises(DFlashError, match="drafter_dir.*config.json"):
        load_engine_factory(str(tmp_path / "target"), str(tmp_path / "nodrafter"))
    with pytest.raises(DFlashError, match="engine_backend"):
        load_engine_factory(str(tmp_path / "target"), str(tmp_path), engine_backend="trt")
    with pytest.raises(DFlashError, match="draft_cutoff=1.5"):
        load_engine_factory(str(tmp_path / "target"), str(tmp_path), draft_cutoff=1.5)


def test_engine_loader_passes_the_draft_cutoff(tmp_path):
    target = TargetModel.from_pretrained(tiny_model_dir(tmp_path / "target"), dtype=torch.float32)
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    make = load_engine_factory(str(tmp_path / "target"), str(tmp_path / "drafter"), dtype="float32", draft_cutoff=0.25)
    assert make().draft_cutoff == 0.25


def test_engine_loader_passes_the_proposer(tmp_path):
    """proposer reaches the engine; one the drafter does not fit (hybrid with a DFlash 2 drafter, no per-draft
    probability) fails at the first engine (load time in Triton) with the engine's one line."""
    import dataclasses

    from dflash_trt.config import DrafterConfig
    from dflash_trt.modeling.drafter import DFlashDrafter

    target = TargetModel.from_pretrained(tiny_model_dir(tmp_path / "target"), dtype=torch.float32)
    tiny_drafter(target).save_pretrained(tmp_path / "plain")
    cfg = dataclasses.replace(
        DrafterConfig.for_target(target.config, num_layers=1, block_size=4),
        architectures=["DFlash2DraftModel"],
        family_fields={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3},
    )
    DFlashDrafter(cfg).save_pretrained(tmp_path / "dflash2")
    make = load_engine_factory(str(tmp_path / "target"), str(tmp_path / "plain"), dtype="float32", proposer="ngram")
    assert make().proposer.name == "ngram"
    make = load_engine_factory(str(tmp_path / "target"), str(tmp_path / "dflash2"), dtype="float32", proposer="hybrid")
    with pytest.raises(DFlashError, match="proposer=hybrid: DFlash 2 drafters") as e:
        Orchestrator(make)
    assert "\n" not in str(e.value)


# ---- model repository -------------------------------------------------------------------------
def test_fill_model_repo(tmp_path):
    tpl = default_template_dir()
    used = placeholders(tpl)
    assert {"target_dir", "drafter_dir", "tokenizer_dir", "max_batch", "triton_max_batch_size"} <= set(used)
    values = default_values(tmp_path / "t", tmp_path / "d", dtype="float32")
    out = fill_model_repo(tpl, tmp_path / "repo", values)
    models = {p.name for p in out.iterdir()}
    assert models == {"ensemble", "preprocessing", "postprocessing", "dflash", "dflash_bls", "dflash_unary"}
    for m in models:
        text = (out / m / "config.pbtxt").read_text()
        assert "${" not in text and (out / m / "1").is_dir()
    assert f'string_value: "{(tmp_path / "t").resolve()}"' in (out / "dflash" / "config.pbtxt").read_text()
    assert 'key: "draft_cutoff" value: { string_value: "0.0" }' in (out / "dflash" / "config.pbtxt").read_text()
    assert 'key: "draft_length" value: { string_value: "block" }' in (out / "dflash" / "config.pbtxt").read_text()
    assert 'key: "proposer" value: { string_value: "dflash" }' in (out / "dflash" / "config.pbtxt").read_text()
    assert 'key: "max_queue" value: { string_value: "256" }' in (out / "dflash" / "config.pbtxt").read_text()
    with pytest.raises(DFlashError, match=r"^max_queue=0: must be an integer >= 1"):
        default_values(tmp_path / "t", tmp_path / "d", max_queue=0)
    hybrid = fill_model_repo(tpl, tmp_path / "hybrid" / "repo", {**values, "proposer": "hybrid"})
    assert 'key: "proposer" value: { string_value: "hybrid" }' in (hybrid / "dflash" / "config.pbtxt").read_text()
    # a missing value is refused, naming the placeholder and its file; nothing is written
    partial = dict(values)
    del partial["drafter_dir"]
    with pytest.raises(DFlashError, match=r"drafter_dir \(in dflash/config.pbtxt\)"):
        fill_model_repo(tpl, tmp_path / "repo2", partial)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hybrid", "repo"]
    with pytest.raises(DFlashError, match="unknown"):
        default_values("t", "d", typo=1)


def test_text_front_door_configs_list_exactly_text_inputs(tmp_path):
    """protocol.TEXT_INPUTS is what the ensemble's hand-kept config.pbtxt declares (name, type, optional),
    DIRECT_TEXT_INPUTS what the BLS front doors declare, and what the preprocessing step takes is a part
    of it with the same types."""
    text_format = pytest.importorskip("google.protobuf.text_format")
    pb = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] not installed")

    repo = fill_model_repo(default_template_dir(), tmp_path / "repo", default_values(tmp_path / "t", tmp_path / "d"))

    def inputs(model: str) -> dict:
        cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(), pb.ModelConfig())
        return {i.name: (pb.DataType.Name(i.data_type), not i.optional) for i in cfg.input}

    declared = {m: inputs(m) for m in ("ensemble", "dflash_bls", "dflash_unary", "preprocessing")}
    assert declared["ensemble"] == TEXT_INPUTS
    for model in ("dflash_bls", "dflash_unary"):
        assert declared[model] == DIRECT_TEXT_INPUTS, model
    pre = declared["preprocessing"]
    assert set(pre) < set(TEXT_INPUTS) and {k: TEXT_INPUTS[k][0] for k in pre} == {k: t for k, (t, _) in pre.items()}


def test_sampling_is_validated_by_sampling_params_alone():
    """One home for the sampling rules: a request's Sampling refuses exactly what SamplingParams refuses,
    with its message (max_new_tokens named as the request's max_tokens)."""
    for bad in (dict(temperature=float("nan")), dict(top_p=0.0), dict(top_k=-1), dict(repetition_penalty=0.0)):
        with pytest.raises(DFlashError) as want:
            SamplingParams(max_new_tokens=4, **bad)
        with pytest.raises(RequestError) as got:
            Sampling(4, **bad)
        assert str(got.value) == str(want.value)
    with pytest.raises(RequestError, match=r"^min_tokens=9: must be an integer in 0..max_tokens=4"):
        Sampling(4, min_tokens=9)
    with pytest.raises(RequestError, match=r"^end_id=-2"):
        Sampling(4, end_id=-2)
    assert Sampling(4, end_id=7, temperature=0.5).to_params((2,)) == SamplingParams(
        max_new_tokens=4, temperature=0.5, stop_token_ids=(2, 7), ignore_eos=True
    )


def test_override_parameter_changes_one_line_and_writes_nothing_in_the_build(tmp_path):
    """serve --proposer: a view of the built repository with the engine's proposer changed."""
    built = fill_model_repo(default_template_dir(), tmp_path / "repo", default_values(tmp_path / "t", tmp_path / "d"))
    before = {p: p.read_bytes() for p in built.rglob("*") if p.is_file()}
    view = override_parameter(built, tmp_path / "view", "proposer", "none")
    engine_cfg = (view / "dflash" / "config.pbtxt").read_text()
    assert 'key: "proposer" value: { string_value: "none" }' in engine_cfg
    assert engine_cfg.replace('"none" }', '"dflash" }') == (built / "dflash" / "config.pbtxt").read_text()
    assert (view / "dflash" / "1").resolve() == (built / "dflash" / "1").resolve()
    assert {p.name for p in view.iterdir()} == {p.name for p in built.iterdir()}
    assert all((view / m).is_symlink() for m in ("ensemble", "dflash_bls", "dflash_unary"))
    assert {p: p.read_bytes() for p in built.rglob("*") if p.is_file()} == before
    (built / "dflash" / "config.pbtxt").write_text("backend: 'python'\n")  # no proposer parameter: refused
    with pytest.raises(DFlashError, match="no model sets the 'proposer' parameter"):
        override_parameter(built, tmp_path / "view2", "proposer", "none")
