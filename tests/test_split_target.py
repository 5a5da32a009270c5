"""A target split into pipeline stages across processes (train/split_target.py): a dry run on CPU,
two processes over gloo, each holding half the decoder layers, gives the features a single
process computes -- the collective target_taps for each rank's share (shares of different
sizes and lengths, and an empty one), and a FeatureStore built by both ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_hf, tiny_tokenizer

from dflash_trt.modeling.target import TargetModel
from dflash_trt.train.features import FeatureStore, target_taps
from dflash_trt.train.split_target import stage_bounds

LAYERS = 4
TAPS = [0, 2, 3]  # one on each stage, and the last layer (after the final norm)
SHARES = [[[5, 9, 3, 7, 11, 2], [4, 4, 8]], [[1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31], [12, 13, 14, 15]]]
STORE_SEQS = [[i % 50 + 3 for i in range(k, k + n)] for k, n in ((0, 7), (5, 3), (9, 11), (2, 5), (7, 8))]

WORKER = """
import json, sys, torch, torch.distributed as dist
from dflash_trt.train.features import FeatureStore, target_taps
from dflash_trt.train.split_target import StageTarget
torch.set_num_threads(1)
folder, rank = sys.argv[1], int(sys.argv[2])
cfg = json.loads(open(folder + "/job.json").read())
dist.init_process_group("gloo", init_method="file://" + folder + "/rendezvous", rank=rank, world_size=2)
stage = StageTarget.load(folder + "/target", torch.float32, torch.device("cpu"), rank, 2)
out = {"bounds": [stage.lo, stage.hi]}
out["taps"] = target_taps(stage, cfg["shares"][rank], cfg["taps"])
out["empty"] = target_taps(stage, cfg["shares"][rank] if rank == 0 else [], cfg["taps"])  # a short batch
FeatureStore.build(stage, cfg["store_seqs"], cfg["taps"], __import__("pathlib").Path(folder + "/store"), 2)
torch.save(out, folder + f"/rank{rank}.pt")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    tok = tiny_tokenizer()
    hf = tiny_hf("qwen3", 3, vocab_size=len(tok), num_hidden_layers=LAYERS)
    hf.save_pretrained(folder / "target")
    tok.save_pretrained(folder / "target")
    (folder / "job.json").write_text(json.dumps({"shares": SHARES, "taps": TAPS, "store_seqs": STORE_SEQS}))
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(r)], stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=300)[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(errs)
    whole = TargetModel.from_pretrained(folder / "target", dtype=torch.float32)
    return folder, whole, [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def tolerance(ref: torch.Tensor) -> float:
    """fp32, the same ops as TargetModel.forward, only the kernels' reduction order may differ
    (other thread counts, and the single-process reference pads to another length): each of the
    ~5 chained reductions per layer (q/k/v/o, attention, MLP up/down) over K <= 128 terms may move a
    value by K * 2**-24 of its operands' magnitude, and the 4 layers add these up:
    4 * 5 * 128 * 2**-24 ~ 1.5e-4 relative to the largest feature."""
    return LAYERS * 5 * 128 * 2.0**-24 * float(ref.abs().max())


def test_stages_hold_contiguous_balanced_layers():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(80, 8) == [(10 * s, 10 * s + 10) for s in range(8)]
    assert [hi - lo for lo, hi in stage_bounds(7, 3)] == [2, 2, 3]
    with pytest.raises(Exception, match="cannot be split into 5 stages"):
        stage_bounds(4, 5)


def test_split_taps_equal_single_process_taps(split_run):
    _, whole, ranks = split_run
    assert [r["bounds"] for r in ranks] == [[0, 2], [2, 4]]
    everything = [s for share in SHARES for s in share]
    ref_all = target_taps(whole, everything, TAPS)  # one batch, padded to the longest of all
    row = 0
    for r, share in enumerate(SHARES):
        got = ranks[r]["taps"]
        S = max(map(len, share))
        assert got.shape == (len(share), S, len(TAPS) * whole.config.hidden_size) and got.dtype == torch.float32
        ref = target_taps(whole, share, TAPS)  # the same share in one process
        for k, s in enumerate(share):  # compare real positions (padding rows are not features)
            n = len(s)
            assert (got[k, :n] - ref[k, :n]).abs().max() <= tolerance(ref)
            assert (got[k, :n] - ref_all[row + k, :n]).abs().max() <= tolerance(ref_all)
        row += len(share)
    assert torch.equal(ranks[0]["empty"], ranks[0]["taps"]) and ranks[1]["empty"].shape[0] == 0


def test_split_feature_store_equals_single_process_store(split_run, tmp_path):
    folder, whole, _ = split_run
    FeatureStore.build(whole, STORE_SEQS, TAPS, tmp_path / "one", 2)
    width = len(TAPS) * whole.config.hidden_size
    a = np.memmap(folder / "store" / "features.bin", dtype=np.uint16, mode="r")
    b = np.memmap(tmp_path / "one" / "features.bin", dtype=np.uint16, mode="r")
    assert a.shape == b.shape == (sum(map(len, STORE_SEQS)) * width,)
    split = torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16).float()
    one = torch.from_numpy(np.array(b).view(np.int16)).view(torch.bfloat16).float()
    # bf16 storage: values within the fp32 tolerance may round to neighbouring bf16 numbers (2**-8 relative)
    assert ((split - one).abs() <= tolerance(one) + 2.0**-8 * one.abs()).all()
    assert FeatureStore.holds(folder / "store", STORE_SEQS, TAPS)  # its marker: complete, same fingerprint
    assert json.loads((folder / "store" / "complete").read_text()) == json.loads(
        (tmp_path / "one" / "complete").read_text()
    )


@pytest.mark.parametrize("features", ["online", "offline"])
def test_training_with_a_split_target_equals_one_process(split_run, tmp_path, one_torch_thread, features):
    """`train --split-target` on two gloo ranks (each a pipeline stage and a DDP rank) reaches the
    drafter weights of one process training with the whole target, to fp32 rounding; offline, the
    ranks build the feature store together first."""
    import os

    from test_train_ddp import BASE, _data, _free_port, _same, _weights

    from dflash_trt.train.trainer import TrainConfig, train

    folder, whole, _ = split_run
    data = str(_data(tmp_path / "data", whole))
    cfg = dict(BASE, data=data, max_steps=3, features=features)
    train(TrainConfig(out=str(tmp_path / "one"), **cfg), target=whole, progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    cmd += ["-m", "dflash_trt.cli", "train", "--split-target", "--target", str(folder / "target"), "--dtype", "float32"]
    cmd += ["--out", str(tmp_path / "split"), "--device", "cpu"]
    for k, v in cfg.items():
        flag = "--" + k.replace("_", "-")
        cmd += [flag if v is not False else "--no-" + k.replace("_", "-")] + ([] if isinstance(v, bool) else [str(v)])
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _same(_weights(tmp_path / "split"), _weights(tmp_path / "one"))
