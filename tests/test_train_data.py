"""Training data on disk: offline features recomputed or extended when the data changes, data
generation extending a short shard, the stdlib prompt set."""

import json

import numpy as np
import torch
from conftest import tiny_target

from dflash_trt.train.data import read_sequences
from dflash_trt.train.prompts import load_prompts


def test_offline_features_recomputed_when_data_changes(tmp_path):
    from dflash_trt.train.features import FeatureStore, target_taps

    t = tiny_target("llama")
    a, b = [[1, 2, 3, 4, 5], [6, 7, 8]], [[9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    taps, folder = [0, 1], tmp_path / "features"
    FeatureStore.build(t, a, taps, folder, batch_size=2)
    first = json.loads((folder / "complete").read_text())["fingerprint"]
    FeatureStore.build(t, b, taps, folder, batch_size=2)  # same folder, other data: must not be reused
    assert json.loads((folder / "complete").read_text())["fingerprint"] != first
    store = FeatureStore(folder, [len(s) for s in b], len(taps) * t.config.hidden_size)
    ref = target_taps(t, b, taps).to(torch.bfloat16)
    got = store.get([1, 2], 5)
    # bf16 storage, and the build batched the rows differently from this reference
    assert torch.allclose(got[0].float(), ref[1, :5].float(), atol=1e-2)
    assert torch.allclose(got[1, :2].float(), ref[2, :2].float(), atol=1e-2)


def test_offline_features_extended_when_data_grows(tmp_path, capsys):
    from dflash_trt.train.features import FeatureStore

    t = tiny_target("llama")
    a = [[1, 2, 3, 4, 5], [6, 7, 8]]
    grown = a + [[9, 10, 11], [12, 13, 14, 15, 16]]
    taps = [0, 1]
    width = len(taps) * t.config.hidden_size
    FeatureStore.build(t, a, taps, tmp_path / "f", batch_size=2)
    before = np.fromfile(tmp_path / "f" / "features.bin", dtype=np.uint16).copy()
    FeatureStore.build(t, grown, taps, tmp_path / "f", batch_size=2)
    assert "reusing the features of 2 sequences, computing 2 new ones" in capsys.readouterr().out
    FeatureStore.build(t, grown, taps, tmp_path / "fresh", batch_size=2)
    ext = np.fromfile(tmp_path / "f" / "features.bin", dtype=np.uint16)
    assert np.array_equal(ext[: len(before)], before)  # the old rows were kept, not recomputed
    assert ext.size == sum(map(len, grown)) * width
    got = FeatureStore(tmp_path / "f", [len(s) for s in grown], width).get([2, 3], 5).float()
    ref = FeatureStore(tmp_path / "fresh", [len(s) for s in grown], width).get([2, 3], 5).float()
    assert torch.allclose(got, ref, atol=1e-2)  # new rows equal a build from scratch (bf16)
    marker = json.loads((tmp_path / "f" / "complete").read_text())
    assert marker == json.loads((tmp_path / "fresh" / "complete").read_text()) and marker["num_seqs"] == 4
    FeatureStore.build(t, [[1, 2, 3]] + grown[1:], taps, tmp_path / "f", batch_size=2)  # not a prefix: recompute
    assert "recomputing" in capsys.readouterr().out


def test_generate_data_extends_a_short_last_shard(tmp_path):
    from conftest import tiny_tokenizer

    from dflash_trt.train.data import generate_data

    tok = tiny_tokenizer()
    t = tiny_target("qwen3", vocab_size=len(tok))
    prompts = [
        "def add(a, b):",
        "The quick brown fox",
        "return a + b",
        "lazy dog",
        "def sub(a, b):",
        "jumps over",
        "print(x)",
    ]
    kw = dict(max_new_tokens=6, batch_size=2, shard_size=4, progress=False)
    generate_data(t, tok, prompts[:5], tmp_path / "grown", **kw)  # shard 1 holds one prompt
    first = (tmp_path / "grown" / "data-00001.jsonl").read_text()
    generate_data(t, tok, prompts, tmp_path / "grown", **kw)  # the prompt list grew at the end
    generate_data(t, tok, prompts, tmp_path / "fresh", **kw)
    grown = (tmp_path / "grown" / "data-00001.jsonl").read_text()
    assert grown.startswith(first) and len(grown.splitlines()) == 3
    assert grown == (tmp_path / "fresh" / "data-00001.jsonl").read_text()
    assert len(read_sequences(tmp_path / "grown")) == len(prompts)


def test_stdlib_code_prompts_are_parseable_stubs_in_a_stable_order():
    import ast
    import re

    prompts = load_prompts("stdlib-code")
    assert len(prompts) > 1000 and len(set(prompts)) == len(prompts)
    assert load_prompts("stdlib-code", limit=50) == prompts[:50]
    assert not any(re.search(r"at 0x[0-9a-f]{6}", p) for p in prompts)  # no per-process reprs in defaults
    for p in prompts:
        code = re.search(r"```python\n(.*)```$", p, re.S)
        assert code, p[:200]
        tree = ast.parse(code.group(1))  # the stub itself is valid Python: a def whose body is its docstring
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        assert ast.get_docstring(fn), p[:200]
    # the shuffle mixes modules, so a small --limit is not one module's functions
    assert len({re.search(r"def (\w+)", p).group(1) for p in prompts[:64]}) > 50
