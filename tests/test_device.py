"""Where targets run and in which dtype: api.resolve_device / parse_dtype / native_bf16 and
the --device option of every command that loads a target."""

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.train.trainer import TrainConfig


def test_auto_dtype_is_bf16_for_training_work_only_where_native(monkeypatch):
    """Generation keeps fp32 on CPU (a bf16 verify block rounds differently from a 1-token step, so
    greedy output would stop matching the baseline); training work takes bf16 where it is native."""
    from click.testing import CliRunner

    from dflash_trt import api
    from dflash_trt.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native in (True, False):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda native=native: native)
        assert api.native_bf16() is native
        assert api.parse_dtype("auto") == torch.float32
        assert api.parse_dtype("auto", for_training=True) == (torch.bfloat16 if native else torch.float32)
    assert api.parse_dtype("float32", for_training=True) == torch.float32
    with pytest.raises(ConfigError, match="dtype='bf17'"):
        api.parse_dtype("bf17", for_training=True)
    assert TrainConfig().bf16 is None  # resolved at train time: autocast where bf16 is native
    out = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    assert "--bf16 / --no-bf16" in out and "AVX512-BF16" in out


def test_device_choice_auto_explicit_and_refused(monkeypatch, tmp_path):
    """--device auto takes the GPU where PyTorch sees one (the CLI used to load every target on the
    CPU even on a GPU host); an explicit cpu on a GPU host keeps the CPU's dtype choice; a GPU asked
    for where there is none is one line naming the field, from every subcommand that loads a target."""
    from click.testing import CliRunner
    from conftest import tiny_model_dir

    from dflash_trt import api
    from dflash_trt.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert api.resolve_device("auto") == torch.device("cuda")
    assert api.parse_dtype("auto") == torch.bfloat16
    assert api.parse_dtype("auto", device="cpu") == torch.float32  # not bf16 emulated on the CPU
    assert api.native_bf16("cpu") is False and api.native_bf16() is True
    with pytest.raises(ConfigError, match=r"device='cuda:3': only 1 CUDA GPU"):
        api.resolve_device("cuda:3")
    from dflash_trt.modeling.target import TargetModel

    seen, packed = [], []
    monkeypatch.setattr(
        TargetModel,
        "from_pretrained",
        classmethod(lambda cls, path, dtype, device: seen.append((device, dtype)) or device),
    )
    monkeypatch.setattr("dflash_trt.api.pack_target", packed.append)
    folder = tiny_model_dir(tmp_path / "t")
    api.load_target(str(folder))
    api.load_target(str(folder), device="cpu")
    api.load_target(str(folder), for_training=True, device="cpu")
    assert seen == [
        (torch.device("cuda"), torch.bfloat16),
        (torch.device("cpu"), torch.float32),
        (torch.device("cpu"), torch.float32),
    ]
    assert packed == [torch.device("cpu")]  # CPU weights are packed for inference, not on the GPU or for training
    monkeypatch.undo()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert api.resolve_device("auto") == torch.device("cpu")
    for bad, msg in (
        ("cuda", "sees no CUDA GPU"),
        ("cuda:0", "sees no CUDA GPU"),
        ("tpu", "choose auto, cpu"),
        ("cuda:x", "choose auto, cpu"),
    ):
        with pytest.raises(ConfigError, match=msg):
            api.resolve_device(bad)
    with pytest.raises(ConfigError, match="device='cuda'"):
        TrainConfig(device="cuda")
    tgt, _ = api.load_target(str(folder), device="cpu")
    assert tgt.device == torch.device("cpu") and tgt.dtype == torch.float32
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "t.txt").write_text("def add(a, b):\n    return a + b\n" * 20)
    for args in (
        [
            "data",
            "generate",
            "--target",
            str(folder),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--out",
            str(tmp_path / "d"),
        ],
        ["data", "score", "--target", str(folder), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "s")],
        ["eval", "--target", str(folder), "--drafter", str(tmp_path / "none"), "--prompts", str(tmp_path / "p.jsonl")],
        ["generate", "--target", str(folder), "--random-drafter", "--prompt", "hi"],
        ["train", "--target", str(folder), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")],
    ):
        r = CliRunner().invoke(main, args + ["--device", "cuda"])
        assert r.exit_code != 0, args
        assert "device='cuda'" in r.output and "Traceback" not in r.output, (args, r.output)
        assert not (tmp_path / "d").exists() and not (tmp_path / "o").exists()
