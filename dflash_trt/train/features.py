"""Target features for training: the tapped hidden states of token sequences, computed or stored.

Boundary: `target_taps` is one target forward over right-padded sequences returning the tapped
layers' outputs (no LM head), shared by the trainer (online features, the tap scale), validation
(held-out features) and corpus scoring. `FeatureStore` keeps them on disk for offline training,
keyed by a fingerprint of the sequences, the tap layers and FEATURE_FORMAT. What is tapped
(distill.feature_layers) is decided by the callers. `target_block_logits` gives DSpark's training
the target's logits at the block positions only; `taps_scale` the tap statistics of precondition.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dflash_trt.train.distill import feature_layers
from dflash_trt.train.distributed import share
from dflash_trt.train.precondition import tap_scale
from dflash_trt.train.split_target import StageTarget


@torch.no_grad()
def target_taps(target, seqs: list[list[int]], tap_layers: list[int]) -> torch.Tensor:
    """Tapped hidden states [N, S, taps*d] of right-padded sequences (padding is causal-invisible).
    A split target (train/split_target.py) makes this collective: every rank calls it with its own
    sequences, in step."""
    if isinstance(target, StageTarget):
        return target.taps(seqs, tap_layers)
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    ids = ids.to(target.device)
    no_logits = torch.zeros(len(seqs), 0, dtype=torch.long, device=target.device)  # the LM head is not needed
    return target.forward(ids, target.new_cache(len(seqs), S), tap_layers, logits_at=no_logits).taps


@torch.no_grad()
def target_block_logits(target, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's logits for the token of every block position 1..B-1: ids [N, S] (padded),
    positions [N, J, B] (train/objective.make_blocks) -> [N, J, B-1, V] (position a+k-1 predicts
    token a+k), as family_loss's teacher_logits; only those rows go through the LM head."""
    N, J, B = positions.shape
    at = positions[..., :-1].flatten(1).to(ids.device)
    out = target.forward(ids, target.new_cache(N, ids.shape[1]), None, logits_at=at)
    return out.logits.float().view(N, J, B - 1, -1)


def taps_scale(target, seqs: list[dict], tap_layers: list[int], store=None, num: int = 32) -> torch.Tensor:
    """Per-dimension RMS of the tapped features of the first `num` sequences (train/precondition.py),
    from the offline store when there is one (the bf16 features training sees), else the target."""
    ids = [s["input_ids"] for s in seqs[:num]]
    rows = []
    for i in range(0, len(ids), 4):
        chunk = ids[i : i + 4]
        f = (
            store.get(list(range(i, i + len(chunk))), max(map(len, chunk)))
            if store is not None
            else target_taps(target, chunk, tap_layers).to(torch.bfloat16).cpu()
        )  # same statistic either way
        rows += [f[r, : len(c), : len(tap_layers) * target.config.hidden_size] for r, c in enumerate(chunk)]
    return tap_scale(rows)


# Bumped when the meaning of a stored feature changes, so that older stores are recomputed rather than
# reused: 2 = a tap on the target's last layer is taken after its final norm (HF hidden_states[L], as
# the reference drafters read it), where version 1 stored the pre-norm state.
FEATURE_FORMAT = 2


def _feature_salt(tap_layers: list[int]) -> list[int]:
    return [-FEATURE_FORMAT, *tap_layers]  # negative: cannot collide with a plain list of layer ids


class FeatureStore:
    """Tapped target features of every sequence, bf16 on disk, memory-mapped (offline mode)."""

    def __init__(self, folder: Path, lengths: list[int], width: int):
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.width = width
        self.mm = np.memmap(folder / "features.bin", dtype=np.uint16, mode="r", shape=(int(self.offsets[-1]), width))

    @staticmethod
    def fingerprint(seqs: list[list[int]], salt: list[int]) -> str:
        """sha256 of token sequences plus what else they were used with (the tap layers for features;
        seed and batching for a training run): reusing features for other data or taps would
        silently train on the wrong hidden states (the memmap only knows its row count)."""
        h = hashlib.sha256(json.dumps(list(salt)).encode())
        for s in seqs:
            h.update(np.asarray(s, dtype=np.int64).tobytes() + b"|")
        return h.hexdigest()

    @staticmethod
    def _marker(folder: Path) -> dict:
        """The `complete` marker of a finished build ({} when absent or unreadable)."""
        try:
            prev = json.loads((folder / "complete").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return prev if isinstance(prev, dict) else {}

    @staticmethod
    def holds(folder: Path, seqs: list[list[int]], tap_layers: list[int]) -> bool:
        """Whether `folder` holds the complete features of exactly these sequences and layers."""
        return FeatureStore._marker(folder).get("fingerprint") == FeatureStore.fingerprint(
            seqs, _feature_salt(tap_layers)
        )

    @staticmethod
    def build(target, seqs: list[list[int]], tap_layers: list[int], folder: Path, batch_size: int) -> None:
        """Compute (or reuse) the features of `seqs`. A data folder that only grew at the end (more
        prompts, `data generate` extending it) keeps the features of the sequences it had and computes
        the new ones; anything else is recomputed from scratch. With a split target every rank calls
        this (collective): rank 0 decides and prepares the file, each rank computes its share of
        every batch through the pipeline and writes its own rows."""
        if FeatureStore.holds(folder, seqs, tap_layers):  # every rank reads the same marker: no collective
            return
        split = isinstance(target, StageTarget)
        width = len(tap_layers) * target.config.hidden_size
        fp = FeatureStore.fingerprint(seqs, _feature_salt(tap_layers))
        start = FeatureStore._prepare(folder, seqs, tap_layers, width, fp) if not split or target.rank == 0 else None
        if split:
            box = [start]
            dist.broadcast_object_list(box, 0)
            start = box[0]
        if start is None:
            return
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
        total = int(offsets[-1])
        mm = np.memmap(folder / "features.bin", dtype=np.uint16, mode="r+", shape=(total, width))
        for i in tqdm(range(start, len(seqs), batch_size), desc="precomputing target features"):
            chunk = seqs[i : i + batch_size]
            part = share(chunk, target.rank, target.world) if split else slice(0, len(chunk))
            taps = target_taps(target, chunk[part], tap_layers)
            off = int(offsets[i + part.start])
            for r, s in enumerate(chunk[part]):
                mm[off : off + len(s)] = (
                    taps[r, : len(s)].to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
                )
                off += len(s)
        mm.flush()
        del mm
        if split:
            dist.barrier()  # every rank's rows are written before the marker says complete
        if not split or target.rank == 0:
            (folder / "complete").write_text(json.dumps({"rows": total, "num_seqs": len(seqs), "fingerprint": fp}))

    @staticmethod
    def _prepare(folder: Path, seqs: list[list[int]], tap_layers: list[int], width: int, fp: str) -> int | None:
        """The index of the first sequence to compute (None: the store is complete), with
        features.bin sized for all of them."""
        marker = folder / "complete"
        start = 0
        if marker.is_file():
            prev = FeatureStore._marker(folder)
            if prev.get("fingerprint") == fp:
                return None
            n = prev.get("num_seqs")
            size_ok = (folder / "features.bin").is_file() and (folder / "features.bin").stat().st_size == prev.get(
                "rows", -1
            ) * width * 2
            if (
                isinstance(n, int)
                and 0 < n < len(seqs)
                and size_ok
                and FeatureStore.fingerprint(seqs[:n], _feature_salt(tap_layers)) == prev["fingerprint"]
            ):
                start = n
                print(f"{folder}: reusing the features of {n} sequences, computing {len(seqs) - n} new ones")
            else:
                print(f"{folder}: features were computed from other data or target layers; recomputing")
            marker.unlink()  # an interrupted update recomputes everything next time
        folder.mkdir(parents=True, exist_ok=True)
        total = sum(map(len, seqs))
        if start:
            os.truncate(folder / "features.bin", total * width * 2)
        else:
            np.memmap(folder / "features.bin", dtype=np.uint16, mode="w+", shape=(total, width)).flush()
        return start

    def get(self, idx: list[int], S: int) -> torch.Tensor:
        out = torch.zeros(len(idx), S, self.width, dtype=torch.bfloat16)
        for r, i in enumerate(idx):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            n = min(b - a, S)
            out[r, :n] = torch.from_numpy(np.array(self.mm[a : a + n]).view(np.int16)).view(torch.bfloat16)
        return out


def offline_features(
    cfg, target, dcfg, seqs: list[dict], out: Path, layers: list[int]
) -> tuple[list[int], FeatureStore]:
    """TrainConfig features: offline -- the taps precomputed once into a FeatureStore; returns the layers it holds."""
    fdir = Path(cfg.features_dir or out / "features")
    token_ids = [s["input_ids"] for s in seqs]
    with_teacher = feature_layers(dcfg.target_layer_ids, target.config.num_hidden_layers, True)
    if FeatureStore.holds(fdir, token_ids, with_teacher):
        layers = with_teacher  # a soft-label run's features serve a hard-label run too (teacher unread)
    FeatureStore.build(target, token_ids, layers, fdir, cfg.batch_size)
    return layers, FeatureStore(fdir, [len(s["input_ids"]) for s in seqs], len(layers) * dcfg.hidden_size)
