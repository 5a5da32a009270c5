"""Held-out validation during training: teacher-forced drafter metrics on sequences never trained on.

Boundary: reads a validation data folder once (the target's own answers to held-out prompts, made by
`dflash-trt data generate --validation`), keeps its tapped target features in memory, and scores a
drafter on fixed, evenly spaced anchors: the same loss as training, per-position accuracy and the
teacher-forced acceptance estimate tau_est = 1 + E[accepted prefix]. Fixed anchors make the numbers
comparable across steps and runs; real generation (`dflash-trt eval`) remains the final measurement.

Why: a drafter trained on little data overfits its training distribution (train-batch tau far above
held-out tau), and this is what shows it while training, at a fraction of a real eval's cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.bench.datasets import spread
from dflash_trt.errors import ConfigError
from dflash_trt.train.data import read_sequences
from dflash_trt.train.features import target_taps
from dflash_trt.train.objective import BlockBatch, anchor_range, family_loss, make_blocks, next_tokens, trainable


def fixed_anchors(length: int, prompt_len: int, block_size: int, num: int) -> list[int]:
    """Up to `num` evenly spaced admissible anchors (response positions a with a + B <= length)."""
    lo, hi = anchor_range(length, prompt_len, block_size)
    if hi < lo:
        return []
    n = min(num, hi - lo + 1)
    if n == 1:
        return [lo]
    return sorted({lo + round(i * (hi - lo) / (n - 1)) for i in range(n)})


class Validator:
    def __init__(
        self,
        target,
        data_dir: str | Path,
        tap_layers: list[int],
        block_size: int,
        mask_token_id: int,
        gamma: float,
        max_seq_len: int,
        anchors_per_seq: int = 32,
        max_seqs: int = 64,
        batch_size: int = 4,
    ):
        seqs = [s for s in read_sequences(data_dir) if trainable(s, block_size)]
        if not seqs:
            raise ConfigError(f"val_data {data_dir}: no sequence has a response of >= block_size={block_size} tokens")
        seqs = spread(seqs, max_seqs)  # features of all of them stay in memory
        self.gamma = gamma
        self.batches: list[tuple[torch.Tensor, BlockBatch]] = []
        for i in range(0, len(seqs), batch_size):
            chunk = [s["input_ids"][:max_seq_len] for s in seqs[i : i + batch_size]]
            plens = [s["prompt_len"] for s in seqs[i : i + batch_size]]
            picks = [fixed_anchors(len(c), p, block_size, anchors_per_seq) for c, p in zip(chunk, plens)]
            J = max(map(len, picks))
            if J == 0:
                continue
            anchors = torch.zeros(len(chunk), J, dtype=torch.long)
            valid = torch.zeros(len(chunk), J, dtype=torch.bool)
            ids = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
            for r, (c, a) in enumerate(zip(chunk, picks)):
                ids[r, : len(c)] = torch.tensor(c)
                anchors[r, : len(a)] = torch.tensor(a, dtype=torch.long)
                valid[r, : len(a)] = True
            taps = target_taps(target, chunk, tap_layers).to(torch.bfloat16)  # as offline training sees them
            blocks = make_blocks(
                ids.to(target.device),
                anchors.to(target.device),
                valid.to(target.device),
                block_size,
                mask_token_id,
                next_tokens(seqs[i : i + batch_size], ids.shape[1], target.device),
            )
            self.batches.append((taps, blocks))

    @torch.no_grad()
    def __call__(self, drafter) -> dict:
        was_training = drafter.training
        drafter.eval()
        n = loss = accepted = 0.0
        acc = None
        for taps, blocks in self.batches:
            res = family_loss(drafter, taps, blocks, self.gamma)
            k = res.num_blocks
            n += k
            loss += res.loss.item() * k
            accepted += res.accepted.item() * k
            acc = res.accuracy * k if acc is None else acc + res.accuracy * k
        drafter.train(was_training)
        n = max(n, 1.0)
        return {
            "val_loss": loss / n,
            "val_tau_est": 1.0 + accepted / n,
            "val_acc": [round(a, 4) for a in (acc / n).tolist()],
            "val_blocks": int(n),
        }


class MetricsLog:
    """OUT/metrics.jsonl; on resume, lines from beyond the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path: Path, step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = []
        if path.is_file():
            for ln in path.read_text().splitlines():
                try:
                    if json.loads(ln)["step"] <= step:
                        keep.append(ln)
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass
        path.write_text("".join(k + "\n" for k in keep))

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
