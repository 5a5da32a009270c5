"""The llama-cpp bench method: when it runs or is skipped (and why), and the F32 GGUF it runs on."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_trt.bench import llama_cpp
from dflash_trt.bench.methods import METHODS, MethodUnavailable

gguf = pytest.importorskip("gguf")
KNOWN = "smollm2-135m-instruct"


@pytest.fixture
def installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        llama_cpp.importlib.util,
        "find_spec",
        lambda name, *a: SimpleNamespace(name=name) if name == "llama_cpp" else real(name, *a),
    )


def test_reasons_when_installed(installed):
    ok = dict(target_name=KNOWN, dtype=torch.float32, device="cpu", greedy=True)
    assert llama_cpp.unavailable_reason(**ok) is None
    for change, words in [
        ({"target_name": "/some/folder"}, "not a known hub model"),
        ({"dtype": torch.bfloat16}, "--dtype float32"),
        ({"device": "cuda"}, "CPU build"),
        ({"greedy": False}, "greedily"),
    ]:
        assert words in llama_cpp.unavailable_reason(**{**ok, **change})


def test_skipped_with_install_hint_when_missing(monkeypatch):
    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name, *a: None)
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(target=KNOWN, temperature=0.0), target=SimpleNamespace(dtype=torch.float32), device="cpu"
    )
    method = METHODS["llama-cpp"](ctx)
    assert not method.lossless  # another engine's kernels: reported, never an exactness failure
    with pytest.raises(MethodUnavailable, match="pip install llama-cpp-python"):
        method.prepare()


def test_rewrite_f32_keeps_metadata_and_stores_the_hf_folders_values(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "src.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor(
        "blk.0.ffn_down.weight",
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("output_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    dst = tmp_path / "f32.gguf"
    assert llama_cpp.rewrite_f32(src, dst) == 2
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert after.get_field("llama.block_count").contents() == 1
    assert after.get_field("tokenizer.ggml.tokens").contents() == ["<s>", "a", "b"]
    assert after.get_field("general.file_type").contents() == int(gguf.LlamaFileType.ALL_F32)
    for t_src, t_dst in zip(before.tensors, after.tensors):
        assert t_dst.name == t_src.name and t_dst.tensor_type == gguf.GGMLQuantizationType.F32
        # what hub/models.py saved: transformers' dequantisation, rounded to bfloat16
        want = torch.from_numpy(gguf.quants.dequantize(t_src.data, t_src.tensor_type)).to(torch.bfloat16).float()
        assert torch.equal(torch.from_numpy(np.array(t_dst.data)).reshape(want.shape), want)
    assert not torch.equal(torch.from_numpy(norm), torch.from_numpy(norm).to(torch.bfloat16).float())  # rounding ran
