"""Multi-process training (torchrun, gloo on CPU): two ranks splitting every batch reach the weights
of one process on the whole batch, and a checkpoint written at one world size resumes at another
to the weights of a run that never stopped; a DSpark run (target logits per share) splits the same way.

This file is also the ranks' program: `python -m torch.distributed.run --nproc_per_node 2 THIS RUNS`
trains each run of the JSON list RUNS in turn (see _launch).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from dflash_trt.config import SamplingParams
from dflash_trt.decoding.loop import generate_baseline
from dflash_trt.errors import ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.trainer import TrainConfig, train

# 12 sequences, 4 per global batch, 2 epochs: 6 steps
BASE = dict(block_size=4, batch_size=4, epochs=2, bf16=False, anchors_per_seq=4, save_every=1, log_every=1)


def _data(folder: Path, target) -> Path:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (3 + i % 5,), generator=g).tolist() for i in range(12)]
    outs = generate_baseline(target, prompts, SamplingParams(max_new_tokens=16, ignore_eos=True)).tokens
    folder.mkdir(parents=True)
    with open(folder / "data-00000.jsonl", "w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"input_ids": p + o, "prompt_len": len(p)}) + "\n")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(runs: list[dict]) -> None:
    """Two gloo ranks train `runs` (TrainConfig overrides over BASE) one after another."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), __file__, json.dumps(runs)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _weights(out: Path) -> dict:
    return DFlashDrafter.from_pretrained(out / "drafter").state_dict()


def _same(a: dict, b: dict) -> None:
    """Equal to fp32 rounding (the saved fc weight is the trained one over the tap scale: rtol)."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)  # fp32 rounding


def test_two_ranks_equal_one_process_and_resume_at_any_world_size(tmp_path, one_torch_thread):
    t = tiny_target("qwen3")
    data = str(_data(tmp_path / "data", t))
    cfg = dict(BASE, data=data)
    single = tmp_path / "single"
    train(TrainConfig(out=str(single), **cfg), target=t, progress=False)
    _launch([dict(cfg, out=str(tmp_path / "ddp")), dict(cfg, out=str(tmp_path / "ddp_then_1"), max_steps=3)])
    train(TrainConfig(out=str(tmp_path / "ddp_then_1"), **cfg), target=t, progress=False)  # 2 ranks -> 1
    train(TrainConfig(out=str(tmp_path / "one_then_ddp"), max_steps=3, **cfg), target=t, progress=False)
    spark = dict(cfg, family="dspark", family_fields={"markov_rank": 16, "confidence_head_alpha": 1.0}, max_steps=2)
    train(TrainConfig(out=str(tmp_path / "spark1"), **spark), target=t, progress=False)
    _launch([dict(cfg, out=str(tmp_path / "one_then_ddp")), dict(spark, out=str(tmp_path / "spark2"))])
    ref = _weights(single)
    for name in ("ddp", "ddp_then_1", "one_then_ddp"):
        _same(ref, _weights(tmp_path / name))
        state = torch.load(tmp_path / name / "checkpoint" / "trainer_state.pt", weights_only=False)
        assert state["step"] == 6
    _same(_weights(tmp_path / "spark1"), _weights(tmp_path / "spark2"))  # a family: its target logits per share
    rows = [json.loads(ln) for ln in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))  # written once (rank 0), every step
    singles = [json.loads(ln) for ln in (single / "metrics.jsonl").read_text().splitlines()]
    for r, s in zip(rows, singles):  # the logged loss is the global batch's, as one process logs it
        assert abs(r["loss"] - s["loss"]) < 1e-4, (r, s)


def test_world_size_must_divide_the_global_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"^batch_size=4: must divide evenly among WORLD_SIZE=3 ranks$"):
        TrainConfig(batch_size=4)
    TrainConfig(batch_size=6)


def _rank_main(runs: list[dict]) -> None:
    torch.set_num_threads(1)
    t = tiny_target("qwen3")
    for run in runs:
        train(TrainConfig(**run), target=t, progress=False)
    from dflash_trt.train import distributed

    distributed.shutdown()


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
