"""scripts/gpu_train_run.py: the weight transport (k-bit groups, parts) and the whole time-boxed run
on CPU with a tiny target, so that the one GPU call it is written for does not fail on its logic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_model_dir
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_train_run.py"


@pytest.fixture(scope="module")
def g():
    spec = importlib.util.spec_from_file_location("gpu_train_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_group_quantization_within_half_a_step(g, bits):
    torch.manual_seed(bits)
    w = torch.randn(48, 128) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different scale
    w[3, :64] = 0.0  # an all-zero group
    codes, scale = g.quantize(w, bits)
    assert len(codes) == w.numel() * bits // 8 and scale.shape == (w.numel() // g.GROUP,)
    back = g.dequantize(codes, scale, list(w.shape), bits, "cpu").float()
    step = scale.float().repeat_interleave(g.GROUP).reshape(w.shape)
    err = (back - w).abs()
    # half a quantization step, plus the bf16 rounding of the result
    assert (err <= step / 2 + w.abs() * 2**-8 + 1e-6).all()
    assert torch.equal(back[3, :64], torch.zeros(64, dtype=torch.float32))
    assert (err.max() > 0) and (g.quantize(w, bits)[0] == codes)  # lossy but deterministic


def test_pack_unpack_round_trip(g, tmp_path):
    src = tiny_model_dir(tmp_path / "m", family="qwen2")
    g.pack(src, tmp_path / "parts", 6, 0.05)
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert "side" in parts and len(parts) >= 3  # the tiny model is > 1 MiB: several parts
    for p in (tmp_path / "parts").glob("p*/blob"):
        assert p.stat().st_size <= 0.05 * 2**20
    dest = g.unpack(tmp_path / "parts", tmp_path / "back", "cpu")
    a, b = load_file(str(next(src.glob("model*.safetensors")))), load_file(str(dest / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        rel = (a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp_min(1e-12)
        assert rel < (0.03 if a[k].dim() == 2 else 1e-2), (k, rel)
    for f in src.iterdir():
        if not f.name.startswith("model"):
            assert (dest / f.name).read_bytes() == f.read_bytes(), f.name
    (tmp_path / "parts" / "p01" / "blob").unlink()
    with pytest.raises(SystemExit, match=r"parts \[1\] of"):
        g.unpack(tmp_path / "parts", tmp_path / "back2", "cpu")


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_run_end_to_end_on_cpu(g, tmp_path, monkeypatch, family):
    """Every stage of the device run with a tiny target and a budget of seconds: the drafter, the
    answers and the logs come back, and the drafter (of the --family asked for) loads and generates exactly.
    DSpark warm-starts on a DFlash drafter with a frozen backbone (--init-from, --freeze-backbone)."""
    src = tiny_model_dir(tmp_path / "m", family="qwen2")
    warm = []
    if family == "dspark":
        from dflash_trt.modeling.target import TargetModel

        backbone = tiny_drafter(TargetModel.from_pretrained(src, dtype=torch.float32), block_size=16, num_layers=1)
        backbone.save_pretrained(tmp_path / "backbone")
        warm = ["--init-from", str(tmp_path / "backbone"), "--freeze-backbone"]
    g.pack(src, tmp_path / "parts", 6, 0.05)
    for name in ("val_prompts.jsonl", "eval_prompts.jsonl"):
        (tmp_path / name).write_text(
            "".join(json.dumps({"prompt": f"def f{i}(x):\n    return"}) + "\n" for i in range(4))
        )
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"def add{i}(a, b):"}) + "\n" for i in range(12))
    )
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n\n" * 200)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "gpu_train_run.py",
            "run",
            "--parts",
            str(tmp_path / "parts"),
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--device",
            "cpu",
            "--budget",
            "60",
            "--answers-s",
            "1",
            "--gen-batch",
            "8",
            "--new-tokens",
            "24",
            "--score-s",
            "0.5",
            "--score-chunk",
            "8",
            "--score-batch",
            "8",
            "--train-batch",
            "4",
            "--reserve-s",
            "50",
            "--max-epochs",
            "1",
            "--val-prompts",
            str(tmp_path / "val_prompts.jsonl"),
            "--eval-prompts",
            str(tmp_path / "eval_prompts.jsonl"),
            "--prompts",
            str(tmp_path / "train.jsonl"),
            "--text",
            str(tmp_path / "text.txt"),
            "--family",
            family,
            "--family-fields",
            '{"markov_rank": 16, "sample_from_anchor": false}' if family == "dspark" else "{}",
            *warm,
        ],
    )
    g.main()
    log = (out / "run.log").read_text()
    assert "FAILED" not in log, log
    assert "GPU eval: tau" in log and "done" in log
    assert json.loads((out / "eval_gpu.json").read_text())["num_prompts"] == 4
    assert (out / "answers.tar.xz").stat().st_size > 0 and (out / "metrics.jsonl").is_file()
    import tarfile

    raw = b"".join((out / f"drafter.tar.{i}").read_bytes() for i in range(len(list(out.glob("drafter.tar.*")))))
    (tmp_path / "d.tar").write_bytes(raw)
    with tarfile.open(tmp_path / "d.tar") as tf:
        tf.extractall(tmp_path / "shipped", filter="data")
    from dflash_trt.api import load_drafter, load_target

    tgt, _ = load_target(str(src), device="cpu")
    drafter = load_drafter(tgt, str(tmp_path / "shipped" / "drafter"))
    assert drafter.block_size == 16
    arch = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[family]
    assert drafter.config.architectures == [arch] and f"train ({family}):" in log
    if warm:  # the frozen backbone came back unchanged (up to the bf16 the run ships in)
        got = dict(drafter.named_parameters())
        for name, p in backbone.named_parameters():
            if name in got and not name.startswith(("markov", "confidence")):
                assert torch.equal(got[name].float(), p.bfloat16().float()), name
