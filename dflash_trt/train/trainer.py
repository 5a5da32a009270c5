"""Drafter training loop: TrainConfig (YAML + CLI overrides), features online or offline,
AdamW with cosine schedule, resumable atomic checkpoints.

Boundary: orchestration only; the objective is in objective.py, data formats in data.py, checkpoint
save / resume in checkpoint.py, the target forward that taps features and the offline feature store
in features.py.
Determinism: the epoch order and every batch's anchors derive from (seed, index), never from a
running RNG, so a run resumed from a checkpoint at step k reaches the same weights as one that
never stopped.

Output folder:
  OUT/checkpoint/  drafter (z-lab layout) + trainer_state.pt, replaced atomically every save_every steps
  OUT/drafter/     the final drafter (z-lab layout), loadable by DFlashDrafter.from_pretrained
  OUT/metrics.jsonl  train metrics every log_every steps; held-out (val_data) metrics at every save
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.api import load_target, native_bf16, resolve_device
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import ConfigError
from dflash_trt.modeling.drafter import DFlashDrafter
from dflash_trt.train.checkpoint import check_resume, resume, save_checkpoint, trainer_state
from dflash_trt.train.data import read_sequences
from dflash_trt.train.distill import feature_layers, soft_labels, split_features
from dflash_trt.train.features import FeatureStore, target_taps
from dflash_trt.train.objective import (
    cosine_lr,
    default_gamma,
    dflash_loss,
    make_blocks,
    next_tokens,
    sample_anchors,
    trainable,
)
from dflash_trt.train.precondition import tap_scale, use_tap_scaling
from dflash_trt.train.validate import Validator, is_validation


@dataclass
class TrainConfig:
    target: str = ""  # target model: known name or HF folder
    data: str = ""  # folder(s) of data-*.jsonl shards (data generate / data score), comma-separated to mix
    out: str = ""  # output folder (checkpoint/ and drafter/)
    num_layers: int = 1  # drafter decoder layers
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # default: 5 evenly spread target layers
    anchors_per_seq: int = 16  # blocks trained per sequence, resampled each epoch
    gamma: float | None = None  # loss decay; default 7 for B=16, 5 for B=10, 4 for B=8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (schedule still spans all epochs)
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1
    max_seq_len: int = 1024  # longer sequences are truncated
    bf16: bool | None = (
        None  # bf16 autocast, fp32 master weights; default: where bf16 GEMMs are native (GPU, AVX512-BF16/AMX CPU)
    )
    features: str = "online"  # online: target forward per step; offline: precomputed once to disk
    features_dir: str | None = None  # offline features location (default OUT/features)
    draft_vocab: int = 0  # 0: full vocabulary; N: the head covers the N most frequent response tokens (faster)
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"  # target weights dtype (auto: bf16 where bf16 GEMMs are native, else fp32)
    device: str = "auto"  # where target and drafter run: auto (a CUDA GPU if any, else CPU) | cpu | cuda | cuda:N
    val_data: str | None = None  # held-out data folder (data generate --validation): metrics at every save
    tap_scaling: bool = True  # train fc on taps / their per-dim RMS (target layers differ 10-100x); folded on save
    kd_weight: float = 0.0  # soft labels: loss = (1-a)*CE(label) + a*CE(target dist); > 0 also stores its last layer

    def __post_init__(self):
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: must be >= 2")
        if self.max_seq_len <= self.block_size:
            raise ConfigError(f"block_size={self.block_size} must be smaller than max_seq_len={self.max_seq_len}")
        if self.features not in ("online", "offline"):
            raise ConfigError(f"features={self.features!r}: choose 'online' or 'offline'")
        for name in ("num_layers", "anchors_per_seq", "epochs", "batch_size", "grad_accum", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.draft_vocab < 0:
            raise ConfigError(f"draft_vocab={self.draft_vocab}: must be 0 (full vocabulary) or a token count")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        resolve_device(self.device)  # a GPU asked for where there is none fails here, naming the field
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ConfigError(
                f"kd_weight={self.kd_weight}: must be in [0, 1] (0: hard labels only, 1: soft labels only)"
            )


def _tap_scale(
    target, seqs: list[dict], tap_layers: list[int], store: FeatureStore | None, num: int = 32
) -> torch.Tensor:
    """Per-dimension RMS of the tapped features of the first `num` sequences (see precondition.py),
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


def frequent_tokens(seqs: list[dict], n: int) -> torch.Tensor:
    """Sorted ids of the n most frequent label tokens, i.e. response tokens or, for teacher-forced
    text, the target's greedy predictions (ties: lower id first) -> [<= n]."""
    counts: dict[int, int] = {}
    for s in seqs:
        labels = s["target_next"][s["prompt_len"] - 1 :] if "target_next" in s else s["input_ids"][s["prompt_len"] :]
        for t in labels:
            counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return torch.tensor(sorted(top), dtype=torch.long)


class _MetricsLog:
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


def _data_folders(cfg: TrainConfig) -> list[str]:
    """cfg.data's folders; refused when none is given, or when one is a validation set (or val_data)."""
    if not cfg.out:
        raise ConfigError("out: give an output folder")
    folders = [f for f in cfg.data.split(",") if f.strip()]
    if not folders:
        raise ConfigError("data: give a data folder (dflash-trt data generate / data score)")
    for folder in folders:
        if is_validation(folder):
            raise ConfigError(
                f"data {folder}: this is a validation set (made with --validation, from held-out "
                f"prompts); train on other data and pass it as val_data instead"
            )
        if cfg.val_data and Path(cfg.val_data).resolve() == Path(folder).resolve():
            raise ConfigError(
                f"val_data {cfg.val_data}: is the training data itself; held-out metrics need other "
                f"sequences (dflash-trt data generate --validation)"
            )
    return folders


def _training_sequences(cfg: TrainConfig, folders: list[str]) -> list[dict]:
    """The folders' sequences with a response of at least one block, cut to max_seq_len."""
    seqs = [s for folder in folders for s in read_sequences(folder) if trainable(s, cfg.block_size)]
    if not seqs:
        raise ConfigError(
            f"data {cfg.data}: no sequence has a response of >= block_size={cfg.block_size} tokens; "
            f"generate longer responses or lower block_size"
        )
    for s in seqs:
        s["input_ids"] = s["input_ids"][: cfg.max_seq_len]
        if "target_next" in s:
            s["target_next"] = s["target_next"][: cfg.max_seq_len]
    return seqs


def _drafter_config(cfg: TrainConfig, target, seqs: list[dict]) -> tuple[DrafterConfig, torch.Tensor | None]:
    """The drafter's shape for this target, and its draft vocabulary (None: the target's whole one)."""
    dcfg = DrafterConfig.for_target(
        target.config, num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids
    )
    vocab = None
    if cfg.draft_vocab:
        vocab = frequent_tokens(seqs, min(cfg.draft_vocab, target.vocab_size))
        dcfg.draft_vocab_size = len(vocab)
    return dcfg, vocab


def _offline_features(
    cfg: TrainConfig, target, dcfg: DrafterConfig, seqs: list[dict], out: Path, layers: list[int]
) -> tuple[list[int], FeatureStore]:
    """features: offline -- the taps precomputed once into a FeatureStore; returns the layers it holds."""
    fdir = Path(cfg.features_dir or out / "features")
    token_ids = [s["input_ids"] for s in seqs]
    with_teacher = feature_layers(dcfg.target_layer_ids, target.config.num_hidden_layers, True)
    if FeatureStore.holds(fdir, token_ids, with_teacher):
        layers = with_teacher  # a soft-label run's features serve a hard-label run too (teacher unread)
    FeatureStore.build(target, token_ids, layers, fdir, cfg.batch_size)
    return layers, FeatureStore(fdir, [len(s["input_ids"]) for s in seqs], len(layers) * dcfg.hidden_size)


def _micro_batch_indices(num_seqs: int, batch_size: int, seed: int, i: int, per_epoch: int) -> list[int]:
    """The sequences of global micro-batch i: its epoch's order derives from (seed, epoch) alone."""
    epoch, pos = divmod(i, per_epoch)
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return order[pos * batch_size : (pos + 1) * batch_size].tolist()


def _micro_batch_loss(
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    target,
    drafter: DFlashDrafter,
    seqs: list[dict],
    idx: list[int],
    i: int,
    store: FeatureStore | None,
    layers: list[int],
    gamma: float,
    autocast,
):
    """The DFlash loss of micro-batch i (sequences idx), before backward; and its token count."""
    batch = [seqs[j] for j in idx]
    lens = [len(s["input_ids"]) for s in batch]
    S = max(lens)
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : lens[r]] = torch.tensor(s["input_ids"])
    ids = ids.to(target.device)
    feats = (
        store.get(idx, S).to(target.device) if store else target_taps(target, [s["input_ids"] for s in batch], layers)
    )
    taps, teacher = split_features(feats, dcfg.num_taps, dcfg.hidden_size)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)  # anchors from (seed, index): resumable
    anchors, valid = sample_anchors(lens, [s["prompt_len"] for s in batch], cfg.anchors_per_seq, cfg.block_size, gen)
    blocks = make_blocks(
        ids,
        anchors.to(ids.device),
        valid.to(ids.device),
        cfg.block_size,
        dcfg.mask_token_id,
        next_tokens(batch, S, ids.device),
    )
    soft = soft_labels(drafter, teacher, blocks.positions) if teacher is not None and cfg.kd_weight else None
    with autocast:
        res = dflash_loss(drafter, taps, blocks, gamma, soft, cfg.kd_weight)
    return res, sum(lens)


def _log_step(bar, metrics: _MetricsLog, step: int, res, lr: float, tok_s: float) -> None:
    acc = res.accuracy.tolist()
    bar.set_postfix(
        loss=f"{res.loss.item():.3f}",
        acc1=f"{acc[0]:.2f}",
        tau_est=f"{1 + res.accepted.item():.2f}",
        tok_s=f"{tok_s:.0f}",
        lr=f"{lr:.1e}",
    )
    metrics.write(
        {
            "step": step,
            "loss": res.loss.item(),
            "acc": [round(a, 4) for a in acc],
            "tau_est": 1 + res.accepted.item(),
            "lr": lr,
            "tok_s": tok_s,
        }
    )


def _log_validation(bar, metrics: _MetricsLog, step: int, v: dict) -> None:
    metrics.write({"step": step, **v})
    bar.write(
        f"step {step}: held-out loss {v['val_loss']:.3f}, tau_est {v['val_tau_est']:.2f}, "
        f"acc@1 {v['val_acc'][0]:.2f} ({v['val_blocks']} blocks)"
    )


def train(cfg: TrainConfig, target=None, progress: bool = True) -> Path:
    """Train a drafter for cfg.target on cfg.data; returns OUT/drafter. Resumes from OUT/checkpoint."""
    folders = _data_folders(cfg)
    out = Path(cfg.out)
    if target is None:
        if not cfg.target:
            raise ConfigError("target: give a target model name or folder")
        target, _ = load_target(cfg.target, cfg.dtype, progress, for_training=True, device=cfg.device)
    seqs = _training_sequences(cfg, folders)
    dcfg, vocab = _drafter_config(cfg, target, seqs)
    ckpt = out / "checkpoint"
    data_fp = FeatureStore.fingerprint([s["input_ids"] for s in seqs], [cfg.seed, cfg.batch_size, cfg.grad_accum])
    state = None
    if (ckpt / "trainer_state.pt").is_file():
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        dcfg.draft_vocab_size = check_resume(ckpt, state, dcfg, data_fp, cfg.tap_scaling)  # its head is kept
    store = None
    layers = feature_layers(dcfg.target_layer_ids, target.config.num_hidden_layers, cfg.kd_weight > 0)
    if cfg.features == "offline":
        layers, store = _offline_features(cfg, target, dcfg, seqs, out, layers)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg).bind(target, cast=False).to(device=target.device, dtype=torch.float32).train()
    if vocab is not None and state is None:
        drafter.draft_vocab.copy_(vocab)
    if cfg.tap_scaling:  # the scale is kept in the trainer state: a resumed run uses the same one
        scale = state["tap_scale"] if state is not None else _tap_scale(target, seqs, dcfg.target_layer_ids, store)
        use_tap_scaling(drafter, scale)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = max(1, cfg.epochs * per_epoch // cfg.grad_accum)
    stop_at = min(total, cfg.max_steps or total)
    step = resume(ckpt, state, drafter, opt, cfg.tap_scaling)
    validator = None
    if cfg.val_data:
        validator = Validator(
            target, cfg.val_data, dcfg.target_layer_ids, cfg.block_size, dcfg.mask_token_id, gamma, cfg.max_seq_len
        )
    metrics = _MetricsLog(out / "metrics.jsonl", step)
    use_bf16 = native_bf16(target.device) if cfg.bf16 is None else cfg.bf16
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    bar = tqdm(total=stop_at, initial=step, desc="training drafter", disable=not progress)
    t0, seen = time.perf_counter(), 0
    while step < stop_at:
        lr = cosine_lr(step, total, cfg.lr, cfg.warmup_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for m in range(cfg.grad_accum):
            i = step * cfg.grad_accum + m  # global micro-batch index
            idx = _micro_batch_indices(len(seqs), cfg.batch_size, cfg.seed, i, per_epoch)
            res, tokens = _micro_batch_loss(cfg, dcfg, target, drafter, seqs, idx, i, store, layers, gamma, autocast)
            (res.loss / cfg.grad_accum).backward()
            seen += tokens
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == stop_at:
            _log_step(bar, metrics, step, res, lr, seen / (time.perf_counter() - t0))
        if step % cfg.save_every == 0 or step == stop_at:
            if validator is not None:
                _log_validation(bar, metrics, step, validator(drafter))
            save_checkpoint(ckpt, drafter, trainer_state(cfg, drafter, opt, step, data_fp))
    bar.close()
    final = out / "drafter"
    DFlashDrafter.from_pretrained(ckpt).save_pretrained(final)
    return final
