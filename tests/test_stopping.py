"""The model's default stop ids have one home (decoding/stopping.py model_stop_ids): the rule by hand,
the target adapter's ids read from its folder (with and without tokenizer.json), and the served engine
stopping at the same ids as in-process generate() for a model whose tokenizer holds both <|im_end|>
(its eos) and <|endoftext|> (a chat end token no config names)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from conftest import tiny_drafter, tiny_model_dir
from serving_common import serve_one

from dflash_trt.api import load_tokenizer, stop_ids
from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate
from dflash_trt.decoding.stopping import target_stop_ids
from dflash_trt.errors import CheckpointError
from dflash_trt.modeling.stop_ids import model_stop_ids, tokenizer_stops
from dflash_trt.modeling.target import TargetModel
from dflash_trt.serving.engine_factory import load_engine_factory
from dflash_trt.serving.protocol import Sampling, TokenRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def test_model_stop_ids_is_the_union_of_configs_tokenizer_and_chat_end_tokens():
    cfg, gen = types.SimpleNamespace(eos_token_id=7), types.SimpleNamespace(eos_token_id=[7, 9])
    vocab = {"<|im_end|>": 3, "<|eot_id|>": 11, "hello": 5}
    assert model_stop_ids(cfg, gen, vocab, tokenizer_eos_id=4) == {3, 4, 7, 9, 11}
    assert model_stop_ids(None, None, None) == frozenset()
    assert model_stop_ids(types.SimpleNamespace(eos_token_id=None), gen, {"hello": 5}) == {7, 9}


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stopping")
    tiny_model_dir(root / "target")
    target = TargetModel.from_pretrained(root / "target", dtype=torch.float32)
    tiny_drafter(target).save_pretrained(root / "drafter")
    return root


def test_target_carries_the_ids_of_its_tokenizer_and_configs(pair_dir, tmp_path):
    folder = pair_dir / "target"
    tok = load_tokenizer(folder)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == im_end and im_end != eot
    target = TargetModel.from_pretrained(folder, dtype=torch.float32)
    assert target.stop_ids == target_stop_ids(target) == {im_end, eot} == set(stop_ids(tok))
    # the same ids from tokenizer_config.json alone (a folder without tokenizer.json), as
    # transformers 4.x writes it for SentencePiece-only tokenizers: added tokens by id
    added = {str(i): {"content": t, "special": True} for t, i in (("<|endoftext|>", eot), ("<|im_end|>", im_end))}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert tokenizer_stops(tmp_path) == ({"<|endoftext|>": eot, "<|im_end|>": im_end}, im_end)
    assert tokenizer_stops(tmp_path / "nothing") == ({}, None)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not readable JSON"):
        tokenizer_stops(tmp_path)
    # a config edited after load still counts (stop_ids is read, not frozen at load)
    target.config.eos_token_id = 5
    assert target.stop_ids == {im_end, eot, 5}


def test_a_test_double_without_a_folder_falls_back_to_its_configs():
    fake = types.SimpleNamespace(config=types.SimpleNamespace(eos_token_id=3), hf=types.SimpleNamespace())
    assert target_stop_ids(fake) == {3}


def test_served_engine_stops_at_the_same_ids_as_in_process_generate(pair_dir):
    """Every token but <|endoftext|> is banned, so greedy decoding writes it first: a stop for
    in-process generate() (api.stop_ids) and, with the rule in one home, for the served engine too."""
    tok = load_tokenizer(pair_dir / "target")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    make = load_engine_factory(str(pair_dir / "target"), str(pair_dir / "drafter"), dtype="float32", max_seq_len=64)
    engine = make()
    banned = tuple((t,) for t in range(engine.target.vocab_size) if t != eot)
    prompt = tok("The quick brown fox")["input_ids"]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=stop_ids(tok), bad_words_ids=banned)
    local = generate(engine.target, engine.drafter, [prompt], params)
    assert (local.tokens[0], local.finish_reasons[0]) == ([eot], "stop")
    last = serve_one(make, TokenRequest(prompt, Sampling(max_tokens=6, bad_words_ids=banned)), timeout=120)[0]
    assert (last.output_ids, last.finish_reason) == ([eot], "stop")
